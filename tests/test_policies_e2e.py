"""`existing`, `dedup` and schedules through the real services (docs/lifecycle.md): one
stack with a standby scheduler, the scenarios side by side to keep within the test budget."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import time
from pathlib import Path

import httpx
import msgspec
from nats.aio.client import Client as NATS
from nats.js.api import DeliverPolicy

from berth import cli
from berth.client import cancel_job, submit_job
from berth.services.scheduler import schedule_fires
from berth.shared import subjects
from berth.shared.messages import (
    DedupPolicy,
    ExistingPolicy,
    JobSpec,
    JobSubmitted,
    Resources,
)
from berth.stack import Stack
from tests.conftest import get_json, wait_for_job, wait_until
from tests.test_cli import berth_in_process

SMALL = Resources(cpu=0.25, memory_mb=64)
EVERY_SECOND = "* * * * * *"  # croniter: seconds are the 6th field


async def fired_jobs(nc: NATS, schedule_id: str) -> list[JobSubmitted]:
    """Every job the log says the schedule made, in log order."""
    made = []
    sub = await nc.jetstream().subscribe(
        subjects.SUBMIT_OUTCOMES_ALL, stream=subjects.EVENTS_STREAM, ordered_consumer=True,
        deliver_policy=DeliverPolicy.ALL)
    try:
        while True:
            msg = await sub.next_msg(timeout=5.0)
            event = msgspec.json.decode(msg.data)
            if event.get("type") == "job_submitted" and event.get("schedule_id") == schedule_id:
                made.append(msgspec.json.decode(msg.data, type=JobSubmitted))
            if msg.metadata.num_pending == 0:
                return made
    finally:
        await sub.unsubscribe()


async def test_existing_dedup_and_a_schedule_across_a_failover(
        make_stack, nc: NATS, tmp_path: Path, capsys) -> None:
    # A short lease: the fail-over below waits one out.
    stack: Stack = make_stack(workers=1, extra_env={"BERTH_LEASE_TTL": "1.5"})
    stack.start_service("scheduler", label="scheduler-2")  # the standby
    # A second submitter: the two share the submit stream's consumer, so concurrent
    # submits of one name are decided by different processes at the same moment.
    stack.start_service("submitter", label="submitter-2")
    # A schedule, made with `berth submit` (as the local user, who may then cancel it).
    data = ["--data-dir", str(stack.data_dir)]
    every_second = tmp_path / "tick.yaml"
    every_second.write_text(f"name: tick\ncommand: ['true']\nresources: {{cpu: 0.25}}\n"
                            f"schedule: {{cron: '{EVERY_SECOND}', timezone: UTC}}\n")
    assert await asyncio.to_thread(cli.main, [*data, "submit", str(every_second)]) == 0
    out, err = capsys.readouterr()
    schedule_id = out.strip()
    assert schedule_id.startswith("s") and err.startswith(
        f"schedule {schedule_id}: '{EVERY_SECOND}' (UTC), first run at ")

    # existing / dedup, keyed by (user, name) and by the spec's hash.
    train = JobSpec(name="train", command=["sleep", "300"], resources=SMALL,
                    existing=ExistingPolicy.ERROR)
    first = await submit_job(nc, train)
    assert first.accepted and first.note == ""
    j1 = str(first.job_id)
    again = await submit_job(nc, train)
    assert not again.accepted
    assert again.reason in (
        f"existing: job 'train' is already {j1} ({state}); cancel it, or submit with "
        "existing: keep or recreate" for state in ("pending", "running"))
    kept = await submit_job(nc, msgspec.structs.replace(
        train, command=["sleep", "301"], existing=ExistingPolicy.KEEP))
    assert (kept.job_id, kept.note) == (j1, f"kept existing {j1}")
    same = await submit_job(nc, msgspec.structs.replace(
        train, existing=None, dedup=DedupPolicy.SPEC))
    assert (same.job_id, same.note) == (j1, f"deduplicated to {j1}")
    # Racing submits, spread over both submitters: one job, each other submit resolved to it.
    race = JobSpec(name="race", command=["sleep", "300"], resources=SMALL,
                   existing=ExistingPolicy.KEEP)
    outcomes = await asyncio.gather(*(submit_job(nc, race) for _ in range(8)))
    made_ids = {o.job_id for o in outcomes}
    assert len(made_ids) == 1, outcomes
    assert sorted(o.note for o in outcomes) == [""] + [f"kept existing {made_ids.pop()}"] * 7
    # Another user's identical spec is another job.
    theirs = await submit_job(nc, msgspec.structs.replace(train, dedup=DedupPolicy.SPEC,
                                                          existing=None), user="ada")
    assert theirs.accepted and theirs.job_id != j1 and theirs.note == ""
    # The API's submit outcome says it too.
    assert get_json(stack, f"/api/submits/{kept.submit_seq}") == {
        "submit_seq": kept.submit_seq, "accepted": True, "job_id": j1, "reason": None,
        "kind": "kept", "note": f"kept existing {j1}"}
    spec_file = tmp_path / "train.json"
    spec_file.write_text(json.dumps({"name": "train", "command": ["sleep", "302"],
                                     "resources": {"cpu": 0.25, "memory_mb": 64},
                                     "existing": "recreate"}))
    # `berth submit` speaks as the local user: its job of the same name is its own.
    j_local = (await asyncio.to_thread(
        berth_in_process, capsys, *data, "submit", str(spec_file)))[1].strip()
    await asyncio.to_thread(cli.main, [*data, "submit", str(spec_file)])
    out, err = capsys.readouterr()
    assert out.strip() != j_local and f"recreated: cancelled {j_local}\n" in err
    recreated = await submit_job(nc, msgspec.structs.replace(
        train, existing=ExistingPolicy.RECREATE))
    assert recreated.accepted and recreated.note == f"recreated: cancelled {j1}"

    # The schedule fires every second; the leader goes; the standby fires on, never a fire
    # time twice, and the times missed while no one led once (the latest of them).
    await wait_until(lambda: get_json(stack, "/api/schedules")[0]["fired"] >= 1,
                     what="a fire")
    # The leader dies (SIGKILL: its lease lapses) while the standby is paused, so for 2 s
    # no scheduler leads and fire times go by; then the standby wakes and takes over.
    standby = stack.children["scheduler-2"]
    standby.send_signal(signal.SIGSTOP)
    leader = stack.children.pop("scheduler")
    stack.supervised.pop("scheduler", None)
    leader.send_signal(signal.SIGKILL)
    await asyncio.to_thread(leader.wait)
    killed_at = time.time()
    await asyncio.sleep(2.0)
    resumed_at = time.time()
    standby.send_signal(signal.SIGCONT)
    standby_log = stack.data_dir / "logs" / "scheduler-2.log"
    await wait_until(lambda: "leading with epoch" in standby_log.read_text(),
                     what="the standby to lead")
    before = len(await fired_jobs(nc, schedule_id))
    await wait_until(lambda: get_json(stack, "/api/schedules")[0]["fired"] >= before + 1,
                     what="a fire by the new leader")
    capsys.readouterr()
    code = await asyncio.to_thread(cli.main, [*data, "schedules", "cancel", schedule_id])
    assert code == 0 and capsys.readouterr().err == f"schedule {schedule_id} cancelled\n"
    listed = await wait_until(lambda: (s := get_json(stack, "/api/schedules")[0])
                              ["cancelled_at"] and s, what="the cancel")
    assert listed["next_run"] is None
    # Only the schedule's owner (or an admin) may cancel it.
    other = await cancel_job(nc, schedule_id, user="ada")
    assert other.reason == f"job_id: no job {schedule_id!r} of 'ada'"
    # Two tries at once for one fire time (a deposed leader racing its successor): one
    # makes it, and one job is made for it; a fire time made already is not made again.
    nxt = float(int(time.time()) + 100)
    js = nc.jetstream()
    wins = await asyncio.gather(schedule_fires.fire(js, schedule_id, nxt),
                                schedule_fires.fire(js, schedule_id, nxt))
    assert sorted(wins) == [False, True]
    assert not await schedule_fires.fire(js, schedule_id, nxt - 50)
    await wait_until(lambda: get_json(stack, "/api/schedules")[0]["last_fire_at"] == nxt,
                     what="the raced fire's job")
    jobs = await fired_jobs(nc, schedule_id)
    # (Sorted: two submitters may store two fires' jobs in either order.)
    times = sorted(j.fire_at for j in jobs)
    assert len(times) == len(set(times)), f"a fire time made twice: {times}"
    assert all(t == int(t) for t in times)
    assert times.count(nxt) == 1
    assert times.pop() == nxt
    # The fire times missed while no one led were started once, as the latest of them: a
    # gap spans the time without a leader, its missed times without a job. (A leader
    # late by more than a second under load leaves a gap of its own, by the same rule.)
    gaps = [(a, b) for a, b in itertools.pairwise(times) if b - a > 1]
    assert any(a <= killed_at and b >= int(resumed_at) and b - a >= 2 for a, b in gaps), (
        killed_at, resumed_at, times)
    # The replaced jobs ended meanwhile.
    await wait_for_job(stack, j_local, {"killed"})
    killed = await wait_for_job(stack, j1, {"killed"})
    assert killed["error"].startswith(f"replaced by {recreated.job_id} (existing: recreate)")
    assert (await cancel_job(nc, str(recreated.job_id))).accepted
    assert (await cancel_job(nc, str(theirs.job_id), user="ada")).accepted
    assert (await cancel_job(nc, str(outcomes[0].job_id))).accepted
    # The web page for them is served (its table is drawn from /api/schedules).
    page = httpx.get(f"{stack.api_url}/schedules", timeout=10)
    assert page.status_code == 200 and 'href="/schedules"' in page.text
    out = (await asyncio.to_thread(berth_in_process, capsys, *data, "schedules"))[1]
    assert schedule_id in out and "cancelled" in out
    listed_json = await asyncio.to_thread(berth_in_process, capsys, *data, "schedules", "--json")
    assert json.loads(listed_json[1])[0]["schedule_id"] == schedule_id
