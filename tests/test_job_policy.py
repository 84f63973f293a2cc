"""`existing` and `dedup` as pure rules (shared/job_policy.py), the fold's side of them
(a recreate cancels what it replaces; a kept submit makes no job), and their bad input."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from berth.services.submitter.intake import intake
from berth.shared import state_snapshot
from berth.shared.job_policy import Known, Verdict, resolve, reusable, spec_hash
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import (
    DedupPolicy,
    ExistingPolicy,
    JobCancelRequested,
    JobSpec,
    JobSubmitted,
    SubmitDeduplicated,
    SubmitRejected,
)
from berth.shared.states import JOB_TERMINAL, JobState

P, R, S, F, K = (JobState.PENDING, JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED,
                 JobState.KILLED)


def spec(**fields: object) -> JobSpec:
    return JobSpec(name="train", command=["python3", "train.py"], user="ada",
                   **fields)  # type: ignore[arg-type]


# (policy, dedup, jobs of the same name, jobs of the same spec) -> verdict
CASES = [
    (None, None, [Known("j1", R)], [Known("j1", R)], Verdict()),
    (ExistingPolicy.ERROR, None, [], [], Verdict()),
    (ExistingPolicy.ERROR, None, [Known("j1", S)], [], Verdict()),  # finished: no collision
    (ExistingPolicy.ERROR, None, [Known("j1", R)], [],
     Verdict(error="existing: job 'train' is already j1 (running); cancel it, or submit "
             "with existing: keep or recreate")),
    (ExistingPolicy.KEEP, None, [Known("j1", F), Known("j2", P), Known("j3", R)], [],
     Verdict(same="j3", how="kept")),  # the newest live one
    (ExistingPolicy.KEEP, None, [Known("j1", K)], [], Verdict()),
    (ExistingPolicy.RECREATE, None, [Known("j1", P), Known("j2", S), Known("j3", R)], [],
     Verdict(replaces=["j1", "j3"])),
    (None, DedupPolicy.SPEC, [], [Known("j1", S)], Verdict(same="j1", how="deduplicated")),
    (None, DedupPolicy.SPEC, [], [Known("j1", S), Known("j2", F)],
     Verdict(same="j1", how="deduplicated")),  # a failed run is not reused; a success is
    (None, DedupPolicy.SPEC, [], [Known("j1", F), Known("j2", K)], Verdict()),
    # dedup first: an identical job makes the name question moot
    (ExistingPolicy.ERROR, DedupPolicy.SPEC, [Known("j1", R)], [Known("j1", R)],
     Verdict(same="j1", how="deduplicated")),
    (ExistingPolicy.RECREATE, DedupPolicy.SPEC, [Known("j1", R)], [Known("j0", F)],
     Verdict(replaces=["j1"])),
]


@pytest.mark.parametrize(("existing", "dedup", "by_name", "by_spec", "verdict"), CASES)
def test_resolve_table(existing: ExistingPolicy | None, dedup: DedupPolicy | None,
                       by_name: list[Known], by_spec: list[Known], verdict: Verdict) -> None:
    assert resolve(spec(existing=existing, dedup=dedup), by_name, by_spec) == verdict


@settings(max_examples=50)
@given(st.lists(st.sampled_from(list(JobState)), max_size=6),
       st.sampled_from([None, *ExistingPolicy]))
def test_a_verdict_never_names_a_finished_job_but_a_success_to_reuse(
        states: list[JobState], existing: ExistingPolicy | None) -> None:
    known = [Known(f"j{i}", s) for i, s in enumerate(states)]
    v = resolve(spec(existing=existing, dedup=DedupPolicy.SPEC), known, known)
    state = dict(zip((k.job_id for k in known), states, strict=True))
    assert all(state[j] not in JOB_TERMINAL for j in v.replaces)
    assert not v.same or reusable(state[v.same])
    assert sum(map(bool, (v.replaces, v.same, v.error))) <= 1


def test_the_spec_hash_ignores_only_the_collision_fields() -> None:
    base = spec()
    assert spec_hash(base) == spec_hash(spec(existing=ExistingPolicy.KEEP,
                                             dedup=DedupPolicy.SPEC))
    assert spec_hash(base) != spec_hash(msgspec.structs.replace(base, user="bob"))
    assert spec_hash(base) != spec_hash(msgspec.structs.replace(base, env={"A": "1"}))
    # The same JSON in another key order is the same spec.
    a = intake(b'{"name": "t", "command": ["x"], "env": {"A": "1", "B": "2"}}', 1, 0, 10**5)
    b = intake(b'{"env": {"B": "2", "A": "1"}, "command": ["x"], "name": "t"}', 2, 0, 10**5)
    assert isinstance(a, JobSubmitted) and isinstance(b, JobSubmitted)
    assert spec_hash(a.spec) == spec_hash(b.spec)


def test_bad_policy_values_are_one_line_naming_the_field() -> None:
    cases = {
        b'{"name": "a", "command": ["x"], "existing": "replace"}': "`$.existing`",
        b'{"name": "a", "command": ["x"], "dedup": "name"}': "`$.dedup`",
        b'{"name": "a", "command": ["x"], "schedule": {"cron": "61 * * * *"}}':
            "schedule.cron: '61 * * * *' is not a cron expression",
        b'{"name": "a", "command": ["x"], "schedule": {"cron": "0 3 * * *", '
        b'"timezone": "Mars/Olympus"}}': "schedule.timezone: unknown time zone 'Mars/Olympus'",
        b'{"name": "a", "command": ["x"], "schedule": {"cron": "0 0 31 2 *"}}':
            "schedule.cron: '0 0 31 2 *' never fires",
    }
    for payload, why in cases.items():
        out = intake(payload, 1, 0, 10**5)
        assert isinstance(out, SubmitRejected), payload
        assert why in out.reason and "\n" not in out.reason, out.reason


def test_the_fold_cancels_what_a_recreate_replaces_and_records_a_kept_submit() -> None:
    state = ClusterState()
    state.apply(1, JobSubmitted(job_id="j1-aaaa", submit_seq=1, spec=spec(), ts=1.0))
    state.apply(2, SubmitDeduplicated(submit_seq=2, job_id="j1-aaaa", how="kept", ts=2.0))
    state.apply(3, JobSubmitted(job_id="j3-bbbb", submit_seq=3, replaces=["j1-aaaa"],
                                spec=spec(existing=ExistingPolicy.RECREATE), ts=3.0))
    old = state.jobs["j1-aaaa"]
    assert old.state == JobState.KILLED
    assert old.error == "replaced by j3-bbbb (existing: recreate)"
    assert state.jobs["j3-bbbb"].replaced == ("j1-aaaa",) and len(state.jobs) == 2
    assert state.same_by_submit == {2: ("j1-aaaa", "kept")}
    # A snapshot keeps both.
    again = state_snapshot.load(state_snapshot.dump(state, "s"), "s", 3)
    assert again.same_by_submit == state.same_by_submit
    assert again.jobs["j3-bbbb"].replaced == ("j1-aaaa",)
    # Folded twice (a redelivery), the replacing job cancels nothing more.
    assert state.apply(3, JobCancelRequested(job_id="j3-bbbb", submit_seq=3, ts=4.0)) == []
