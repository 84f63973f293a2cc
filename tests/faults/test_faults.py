"""The fault suite's quick form (bench/faults.py --quick runs the same scenarios and prints
the table; bench/faults.py the full one): valkey restarted with its data dir emptied under
running tasks, the leader SIGKILLed mid-burst with a standby running, and a fuzz of every
decoder and subject. Each scenario on a fresh stack; every count must read 0. And the
counters themselves, shown to count."""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NATS

from berth.services.dashboard_api.projection import Projection
from berth.shared import subjects
from berth.shared.event_origin import RefusedEvent, read_event
from berth.shared.lifecycle import AttemptView, ClusterState, JobView, TaskView
from berth.shared.messages import JobSpec, JobSubmitted, LeaderAnnouncement, Resources, encode
from berth.shared.states import TaskState
from tests.faults import fuzz, harness
from tests.faults.procs import Sampler, tagged

pytestmark = pytest.mark.faults

QUICK_FUZZ = 3000


QUICK_NAMES = ["valkey-restart-empty", "leader-sigkill", "fuzz"]


@pytest.mark.parametrize("name", QUICK_NAMES)
async def test_fault_scenario_counts_nothing_bad(name: str, tmp_path: Path) -> None:
    counts = await harness.run_scenario(name, tmp_path / "berth", QUICK_FUZZ, quick=True)
    assert counts.acked >= 5, counts
    assert counts.violations() == [], (counts.violations(), counts.notes)
    if name == "valkey-restart-empty":
        # Redis's epoch began at 0 again: the new term took one above the log's.
        epochs = counts.notes["epochs"]
        assert len(epochs) >= 2 and epochs == sorted(set(epochs)), epochs


def test_the_quick_fuzz_covers_every_subject_and_every_kind_of_garbage() -> None:
    workers = ["local-0"]
    sent = list(fuzz.payloads(random.Random(13), QUICK_FUZZ, workers))
    assert {s for s, _ in sent} == {s for _, s in fuzz.targets(workers)}
    payloads = [p for _, p in sent]
    assert fuzz.deep(1000) in payloads
    assert any(len(p) > fuzz.BIG_STRING for p in payloads)
    assert any(p.startswith(fuzz.deep(20_000)[:100]) and len(p) > 40_000 for p in payloads)
    assert any(b"1" + b"0" * 30 in p for p in payloads)
    # Nothing sent to the leader subject reads as an epoch above the first: another epoch
    # there is forged_epochs()'s case (the epoch fence's), not the decoders'.
    announced = []
    for subject, payload in sent:
        if subject == "berth.leader":
            try:
                announced.append(msgspec.json.decode(payload, type=LeaderAnnouncement).epoch)
            except (msgspec.DecodeError, RecursionError):
                announced.append(None)
    assert None in announced and max(e or 0 for e in announced) <= 1


@pytest.mark.parametrize(("violation", "forged"), [
    # Seen in the full fuzz (seed 15, 100,000 payloads): the forgeries alone.
    ("attempt_keys_reused: j1-fuzz0000/0/0: to fuzz-w and to fuzz-w", True),
    ("attempt_keys_reused: j1-fuzz0000/0/-1: to fuzz-w after a void assignment burned the id",
     True),
    ("attempt_keys_reused: j1-fuzz0000/0/1000000000000000000000000000000: to fuzz-w after a "
     "void assignment burned the id", True),
    # A real worker, a real job, or another kind of finding is berth's to answer for.
    ("attempt_keys_reused: j1-fuzz0000/0/0: to fuzz-w and to local-0", False),
    ("attempt_keys_reused: j1-fuzz0000/0/0: to local-0 and to fuzz-w", False),
    ("attempt_keys_reused: j7-0007/0/0: to fuzz-w and to fuzz-w", False),
    ("attempt_keys_reused: j1-fuzz0000/0/0: to fuzz-w and to fuzz-w (redis)", False),
    ("double_booked_hosts: fuzz-w: j1-fuzz0000, j2-0002", False),
])
def test_only_what_the_forgeries_alone_did_is_left_out_of_the_fuzz_count(
        violation: str, forged: bool) -> None:
    assert fuzz.forged_only(violation) is forged


def test_reports_lost_and_applied_twice_are_counted() -> None:
    state = ClusterState()
    spec = JobSpec(name="x", command=["true"], resources=Resources(cpu=1, memory_mb=8))
    attempts = [AttemptView(attempt_id=0, worker_id="w", incarnation="i", exited=True,
                            state=TaskState.FAILED),
                AttemptView(attempt_id=1, worker_id="w", incarnation="i", exited=False),
                AttemptView(attempt_id=2, worker_id="w", incarnation="i", exited=True,
                            worker_failure=True)]
    state.jobs["j1-a"] = JobView(job_id="j1-a", spec=spec, submit_seq=1, submitted_at=0,
                                 tasks=[TaskView(job_id="j1-a", index=0, attempts=attempts)])
    state.jobs["j1-a"].tasks[0].failure_count = 2
    reports = {"j1-a/0/0": {TaskState.FAILED, TaskState.SUCCEEDED}}
    # Attempt 1 never confirmed gone: lost. Attempt 0 reported two ends, and the task
    # counts two failures for one failed attempt: twice, twice.
    assert harness.attempt_counts(state, reports, {"j1-a"}) == (1, 2)
    # Attempt 0 with no report at all, and not written off with its worker: lost too.
    assert harness.attempt_counts(state, {}, {"j1-a"}) == (2, 1)
    assert harness.epochs_reused([1, 2, 2, 5, 3, 6]) == 2


def test_the_sampler_sees_two_live_copies_and_what_outlives_a_run(tmp_path: Path) -> None:
    tag = "faulttok-selftest"
    procs = [subprocess.Popen(["sh", "-c", "sleep 30; :", f"{tag}-1"],
                              env={**os.environ, "BERTH_WORKER_ID": f"w{i}",
                                   "BERTH_ATTEMPT_ID": str(i)}) for i in range(2)]
    sampler = Sampler(tag).start()
    try:
        time.sleep(0.5)
    finally:
        sampler.stop()
        assert len(tagged(tag)) == 2
        for proc in procs:
            proc.kill()
            proc.wait()
    assert list(sampler.overlap) == [f"{tag}-1"]
    assert tagged(tag) == []


def test_the_bench_prints_one_row_per_scenario_with_every_count() -> None:
    from bench.faults import QUICK, table
    from bench.faults import QUICK_FUZZ as BENCH_FUZZ

    assert (QUICK, BENCH_FUZZ) == (QUICK_NAMES, QUICK_FUZZ)  # the same quick form
    rows = table([harness.Counts("a", acked=3), harness.Counts("b", lost=1, died=["x (1)"])])
    head, _, a, b = rows.splitlines()
    assert [c.strip() for c in head.split("|")[2:-4]] == list(harness.COUNTS)
    assert a.split("|")[2].strip() == "3" and b.split("|")[3].strip() == "1"



def test_a_submission_whose_job_id_is_not_one_subject_token_is_refused() -> None:
    # Found by the fuzz: a forged JobSubmitted for job "j0.0000000000000000000001-fuzz0000"
    # was believed; the leader then published its assignment to berth.events.task.j0.000…,
    # which no identity may, and retried that publish for ever: nothing was placed again.
    spec = JobSpec(name="x", command=["true"], resources=Resources(cpu=1, memory_mb=8))
    subject = subjects.submit_outcome(None, 1)
    for job_id in ("j0.1-fuzz", "j1-*", "j1->", "j1 a", ""):
        with pytest.raises(RefusedEvent):
            read_event(subject, encode(JobSubmitted(job_id=job_id, submit_seq=1, spec=spec)))
    assert read_event(subject, encode(JobSubmitted(job_id="j1-ab12", submit_seq=1, spec=spec)))


async def test_a_state_msgpack_cannot_hold_is_not_saved_and_stops_nothing(
        nc: NATS, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Found by the fuzz: a believed event carried an integer past 2**64; the dashboard's
    # snapshot could not encode it, the saver raised, and the dashboard exited with it.
    projection = Projection(nc, 5.0, snapshot_path=tmp_path / "projection.snapshot")
    projection.stream = "BERTH_EVENTS@test"
    projection.state.rejections[10**30] = "forged"
    projection.state.last_seq = 7
    await projection.save_snapshot()
    assert not (tmp_path / "projection.snapshot").exists()
    assert "cannot encode a snapshot up to event 7" in caplog.text
    del projection.state.rejections[10**30]
    projection.state.last_seq = 8
    await projection.save_snapshot()
    assert (tmp_path / "projection.snapshot").exists()
