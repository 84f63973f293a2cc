"""Compaction of finished jobs out of the events stream (docs/retention.md): the fold's drop,
which jobs may go, and what a reader replaying a partly purged log sees."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import cast

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from berth import backup, cli
from berth.services.dashboard_api.projection import Projection
from berth.services.submitter.index import JobIndex
from berth.shared import nats_io, retention, state_snapshot, subjects
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import (
    AnyEvent,
    AttemptReported,
    JobCancelRequested,
    JobsCompacted,
    PendingReason,
    PendingReasonsChanged,
    SubmitDeduplicated,
    encode,
)
from berth.shared.nats_io import RawEvent
from berth.shared.states import JobState, TaskState
from tests.test_fold_fuzz import believed_subject
from tests.test_lifecycle import assigned, registered, report, submitted

S = TaskState
ROOT = Path(__file__).resolve().parent.parent


def at(ts: float, event: AttemptReported) -> AttemptReported:
    return msgspec.structs.replace(event, ts=ts)


def compacted(*job_ids: str, epoch: int = 1) -> JobsCompacted:
    return JobsCompacted(job_ids=list(job_ids), epoch=epoch)


def log_of_two_jobs() -> list[AnyEvent]:
    """j1 finishes at t=100; j2 (after j1) is still running."""
    return [registered(), submitted("j1-0001", replicas=2),
            assigned(0, 0, job="j1-0001"), assigned(0, 1, job="j1-0001"),
            report(0, S.RUNNING, job="j1-0001"), report(0, S.RUNNING, index=1, job="j1-0001"),
            at(100.0, report(0, S.SUCCEEDED, 0, job="j1-0001")),
            at(100.0, report(0, S.SUCCEEDED, 0, index=1, job="j1-0001")),
            submitted("j2-0002"), assigned(0, job="j2-0002"), report(0, S.RUNNING, job="j2-0002")]


def fold_from(events: list[AnyEvent | None], start: int = 1) -> ClusterState:
    """Folds `events` with their stream sequences; None stands for a purged message."""
    state = ClusterState()
    for seq, event in enumerate(events, start=start):
        if event is not None:
            state.apply(seq, event)
    return state


def test_jobs_compacted_drops_the_job_and_everything_it_built() -> None:
    events = log_of_two_jobs()
    state = fold_from([*events, compacted("j1-0001")])
    assert set(state.jobs) == {"j2-0002"}
    assert state.compacted_jobs == 1
    assert state.job_by_submit == {2: "j2-0002"}
    assert state.compacted_live == []
    # j2's attempt still holds its share of the host; j1's held nothing any more.
    assert state.workers["w1"].used == state.jobs["j2-0002"].spec.resources.amounts
    assert list(state.workers["w1"].live_attempts) == ["j2-0002/0/0"]
    # The leader applies its own at once (seq 0), and the log delivers it later: counted once.
    leader = fold_from(events)
    assert leader.apply(0, compacted("j1-0001")) == []
    assert leader.apply(len(events) + 1, compacted("j1-0001")) == []
    assert set(leader.jobs) == {"j2-0002"} and leader.compacted_jobs == 1


def test_only_jobs_finished_for_the_retention_with_every_exit_confirmed_go() -> None:
    state = fold_from(log_of_two_jobs())
    assert retention.compactable(state, now=150.0, older_than=60.0) == []  # 50 s ago
    assert retention.compactable(state, now=160.0, older_than=60.0) == ["j1-0001"]
    # A killed job whose process has not confirmed its exit stays, however old.
    state.apply(0, JobCancelRequested(job_id="j2-0002", submit_seq=9, ts=100.0))
    assert state.jobs["j2-0002"].state == JobState.KILLED
    assert retention.compactable(state, now=1e9, older_than=60.0) == ["j1-0001"]
    state.apply(0, report(0, S.KILLED, job="j2-0002"))
    assert retention.compactable(state, now=1e9, older_than=60.0) == ["j1-0001", "j2-0002"]


def test_a_job_an_unfinished_job_still_waits_on_stays() -> None:
    # j3 waits for j1 (done) and j2 (running): when j2 ends it looks at j1 again.
    state = fold_from([*log_of_two_jobs(), submitted("j3-0003", after=["j1-0001", "j2-0002"])])
    assert state.jobs["j3-0003"].waiting_for == "j2-0002"
    assert retention.compactable(state, now=1e9, older_than=0.0) == []


def test_a_reader_that_saw_the_submit_but_not_the_purged_rest_drops_it_at_the_record() -> None:
    """The purge happened while this reader replayed: it folded j1's submit, then found
    everything else of j1 gone. Until the record j1 looks pending to it; at the record it
    is dropped, and it was never pending after. A leader places only once it has folded
    to its own LeaderElected, which is logged after any earlier leader's record."""
    events = log_of_two_jobs()
    record_seq = len(events) + 1
    purged: list[AnyEvent | None] = [
        e if i in (0, 1, 8, 9, 10) else None for i, e in enumerate(events)]
    state = fold_from(purged[:2])
    assert ("j1-0001", 0) in state.pending  # what it would see mid-replay
    for seq, event in enumerate(purged[2:], start=3):
        if event is not None:
            state.apply(seq, event)
    state.apply(record_seq, compacted("j1-0001"))
    assert "j1-0001" not in state.jobs and not any(k[0] == "j1-0001" for k in state.pending)
    assert state.compacted_live == []
    # A late duplicate of one of its reports changes nothing.
    state.apply(record_seq + 1, report(0, S.SUCCEEDED, 0, job="j1-0001"))
    assert "j1-0001" not in state.jobs


def test_a_reader_that_missed_the_exit_frees_the_host_and_says_so() -> None:
    """Saw j1's assignment but not its (purged) exit: at the record the host is freed in
    its fold, as it is in the log the compactor folded, and the checker is told."""
    events = log_of_two_jobs()
    partial: list[AnyEvent | None] = [
        e if i in (0, 1, 2, 3, 8, 9, 10) else None for i, e in enumerate(events)]
    state = fold_from([*partial, compacted("j1-0001")])
    assert list(state.workers["w1"].live_attempts) == ["j2-0002/0/0"]
    assert state.compacted_live == ["j1-0001/0/0 on w1", "j1-0001/1/0 on w1"]


def test_replay_from_zero_of_the_compacted_log_agrees_with_the_live_fold() -> None:
    events = log_of_two_jobs()
    live = fold_from([*events, compacted("j1-0001")])
    # The stream after the purges: j1's own messages and the shared ones below j2's submit.
    after_purge: list[AnyEvent | None] = [
        e if i in (0, 8, 9, 10) else None for i, e in enumerate(events)]
    replayed = fold_from([*after_purge, compacted("j1-0001")])
    assert set(replayed.jobs) == set(live.jobs) == {"j2-0002"}
    assert replayed.jobs["j2-0002"] == live.jobs["j2-0002"]
    assert replayed.workers["w1"].used == live.workers["w1"].used
    assert replayed.pending == live.pending == {}


def test_what_the_purges_take() -> None:
    events: list[AnyEvent] = [*log_of_two_jobs(),
                              SubmitDeduplicated(submit_seq=7, job_id="j1-0001", how="dedup"),
                              PendingReasonsChanged(reasons=[PendingReason(
                                  job_id="j2-0002", task_index=0, reason="x")], epoch=1)]
    state = fold_from(events)
    assert retention.outcome_seqs(state, ["j1-0001"]) == [1, 7]
    # Nothing below j1's submit (seq 2) concerns only compacted jobs while j1 is folded.
    assert retention.shared_subjects_watermark(state) == 2
    state.apply(len(events) + 1, compacted("j1-0001"))
    assert retention.shared_subjects_watermark(state) == 9  # j2's submit
    assert state.same_by_submit == {}
    state.apply(0, at(100.0, report(0, S.SUCCEEDED, 0, job="j2-0002")))
    state.apply(len(events) + 2, compacted("j2-0002"))
    assert retention.shared_subjects_watermark(state) == len(events) + 3


def test_a_snapshot_keeps_the_count() -> None:
    state = fold_from([*log_of_two_jobs(), compacted("j1-0001")])
    loaded = state_snapshot.load(state_snapshot.dump(state, "s"), "s", state.last_seq)
    assert loaded.compacted_jobs == 1 and set(loaded.jobs) == {"j2-0002"}


def test_check_interval_is_a_tenth_of_the_retention_within_bounds() -> None:
    assert retention.check_interval(7 * 86400) == retention.MAX_CHECK_INTERVAL
    assert retention.check_interval(600) == 60
    assert retention.check_interval(0) == retention.MIN_CHECK_INTERVAL


def test_the_retention_bench_runs_and_compaction_bounds_the_stream() -> None:
    """bench/retention.py --quick: the figures are the benchmark's to report; what is
    checked is that compaction took every earlier round's jobs, and the stream stopped
    growing with them while the uncompacted one did not."""
    done = subprocess.run([sys.executable, "bench/retention.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    rows = report["rows"]
    per_round = report["jobs"] // report["rounds"]
    assert [r["compacted_jobs"] for r in rows] == [0] + [per_round] * (report["rounds"] - 1)
    assert [r["folded_jobs"] for r in rows] == [per_round] * report["rounds"]
    assert rows[-1]["kept_messages"] > report["jobs"] * 5
    # What is left per round past the first: the compaction record (a few bytes a job).
    growth = rows[-1]["bytes"] - rows[0]["bytes"]
    assert growth < (rows[-1]["kept_bytes"] - rows[0]["kept_bytes"]) / 20, report


def test_admin_compact_names_a_bad_duration_in_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["admin", "compact", "--older-than", "a week"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "berth: --older-than: 'a week' is not a duration (seconds, or a number with s, m, h "
        "or d: 15s, 10m, 2h)"]


def test_the_submitters_index_forgets_compacted_jobs() -> None:
    """A later submit with the same name or spec no longer collides with them."""
    index = JobIndex(cast(JetStreamContext, None))
    for event in (submitted("j1-0001"), submitted("j2-0002")):
        index.state.apply(0, event)
        index._add(event)
    index._forget({"j1-0001"})
    assert list(index.by_name.values()) == [["j2-0002"]]
    assert list(index.by_spec.values()) == [["j2-0002"]]
    index._forget({"j2-0002"})
    assert index.by_name == {} and index.by_spec == {}


def test_a_live_dashboard_drops_compacted_jobs_from_its_list_and_timeline() -> None:
    """The projection folding the record as it comes (not rebuilt): the job list and the
    host timeline, indexes of its own beside the fold, lose the jobs too."""
    projection = Projection(NATS(), worker_dead_after=10.0)
    events = [*log_of_two_jobs(), compacted("j1-0001")]
    for seq, event in enumerate(events, start=1):
        subject = believed_subject(event)
        assert subject is not None, event
        projection._apply(RawEvent(seq, encode(event), {}, subject))
    assert set(projection.state.jobs) == {"j2-0002"}
    assert [job.job_id for job in projection.job_order] == ["j2-0002"]
    assert projection.job_order_seqs == [2]
    assert [e.job_id for e in projection.host_attempts["w1"]] == ["j2-0002"]


async def test_a_compacted_stream_backs_up_and_restores_with_its_gaps(nc: NATS) -> None:
    """Purged sequences (in the middle, and the newest) are skipped by the backup, which
    still ends, and stay gaps in the restored stream: every kept event at its sequence."""
    js = nc.jetstream()
    for n in range(6):
        job_id = f"j{n % 3 + 1}-000{n % 3 + 1}"
        await js.publish(subjects.task_events(job_id), encode(assigned(n, job=job_id)),
                         stream=subjects.EVENTS_STREAM)
    await js.purge_stream(subjects.EVENTS_STREAM, subject=subjects.task_events("j3-0003"))
    out = io.StringIO()
    assert await backup.backup(js, out) == 4
    await js.delete_stream(subjects.EVENTS_STREAM)
    await nats_io.ensure_streams(js)
    assert await backup.restore(js, iter(out.getvalue().splitlines())) == 4
    restored = await js.stream_info(subjects.EVENTS_STREAM)
    assert restored.state.messages == 4 and restored.state.last_seq == 5
    kept = [(m.seq, m.subject) for m in [await js.get_msg(subjects.EVENTS_STREAM, seq)
                                         for seq in (1, 2, 4, 5)]]
    assert kept == [(1, subjects.task_events("j1-0001")), (2, subjects.task_events("j2-0002")),
                    (4, subjects.task_events("j1-0001")), (5, subjects.task_events("j2-0002"))]
