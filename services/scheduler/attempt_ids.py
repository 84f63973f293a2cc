"""A task's next attempt id, so that no attempt key is ever used for two assignments.

A worker never starts an attempt key it has seen, so a key reused for a second assignment
never runs there (the leader would re-send it for good). The fold burns the id of a deposed
leader's void late assignment (TaskView.burned_attempt_id); this adds the ids Redis holds
that the fold does not know yet: every reservation a deposed leader made precedes this
term's epoch (reserve.lua is fenced), so a term's first reconcile sees each key such a
leader may have sent (docs/reliability.md, "Late assignments")."""

from __future__ import annotations

from collections.abc import Iterable

from berth.shared.lifecycle import ClusterState, TaskView
from berth.shared.messages import parse_attempt_key

# Per task, the highest attempt id seen in Redis beyond what the fold would hand out.
TakenIds = dict[tuple[str, int], int]


def note_reserved(state: ClusterState, keys: Iterable[str], taken: TakenIds) -> None:
    """Records in `taken` the reserved attempt keys of Redis the fold would reuse; kept
    after their release (a worker may have seen them), only these, so it stays small."""
    for key in keys:
        job_id, index, attempt_id = parse_attempt_key(key)
        task = state.task(job_id, index)
        if task is not None and attempt_id >= next_id(task, taken):
            taken[task.key] = attempt_id


def next_id(task: TaskView, taken: TakenIds) -> int:
    return task.next_attempt_id(taken.get(task.key, -1))
