"""The dashboard with 100,000 tasks projected: how fast it catches up, how fast it answers.

Writes a realistic history into a real nats-server's events stream (workers registered,
jobs submitted, every task assigned, building, running and succeeded: four events per task
and one per job), then starts the real dashboard service as a process and measures:

1. catch-up from sequence 0: events folded per second, and the wall time from process start
   until /healthz says it has caught up;
2. restart from its snapshot (saved on a clean stop): wall time until caught up again;
3. p50/p99 latency of job list pages, filtered lists, job details and task details, over
   HTTP with keep-alive, one request at a time;
4. the dashboard's resident memory.

    .venv/bin/python bench/dashboard.py [--tasks 100000] [--tasks-per-job 100]
    .venv/bin/python bench/dashboard.py --only-catchup [--runs 3] [--profile DIR]
    .venv/bin/python bench/dashboard.py --quick     # small, for CI: steps 1, 3, 4

`--only-catchup` measures step 1 alone (`--runs` times on one stream, each a fresh
dashboard with no snapshot); `--profile DIR` samples each catch-up with py-spy (installed
apart: `pip install py-spy`) and writes DIR/catchup-N.txt, the functions that took most
of the dashboard's time, by own time and by time including callees.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from procstat import cpu_seconds, status_mib  # bench/procstat.py, beside this script

from berth.shared import nats_io, servers, subjects
from berth.shared.credentials import AuthDir
from berth.shared.messages import (
    AttemptReported,
    JobSpec,
    JobSubmitted,
    LeaderElected,
    Resources,
    TaskAssigned,
    WorkerRegistered,
    encode,
)
from berth.shared.states import TaskState
from berth.stack import service_command

WORKERS = 100


def history(tasks: int, per_job: int) -> list[tuple[str, bytes]]:
    """(subject, event JSON) in stream order."""
    out: list[tuple[str, bytes]] = [(subjects.LEADER_EVENTS, encode(
        LeaderElected(scheduler_id="bench", epoch=1, ts=time.time())))]
    for w in range(WORKERS):
        out.append((subjects.worker_events(f"w{w}"), encode(WorkerRegistered(
            worker_id=f"w{w}", incarnation="i1", host=f"host{w}", address=f"10.0.0.{w}",
            resources=Resources(cpu=1000, memory_mb=1_000_000), ts=time.time()))))
    now = time.time()
    jobs = tasks // per_job
    for j in range(jobs):
        seq = j + 1
        job_id = f"j{seq}-{seq % 65536:04x}"
        spec = JobSpec(name=f"sweep-{j % 10}-{j}", user=f"user{j % 7}", replicas=per_job,
                       command=["python3", "train.py", f"--seed={j}"],
                       resources=Resources(cpu=1, memory_mb=100))
        subject = subjects.task_events(job_id)
        out.append((subjects.submit_outcome(None, seq), encode(JobSubmitted(
            job_id=job_id, submit_seq=seq, spec=spec, ts=now))))
        for i in range(per_job):
            worker = f"w{(j * per_job + i) % WORKERS}"
            out.append((subject, encode(TaskAssigned(
                job_id=job_id, task_index=i, attempt_id=0, worker_id=worker,
                incarnation="i1", epoch=1, ts=now))))
            for state in (TaskState.BUILDING, TaskState.RUNNING, TaskState.SUCCEEDED):
                out.append((subjects.attempt_reports(worker), encode(AttemptReported(
                    job_id=job_id, task_index=i, attempt_id=0, worker_id=worker,
                    state=state, exit_code=0 if state == TaskState.SUCCEEDED else None,
                    ts=now))))
    return out


async def fill_stream(server: servers.ServerProcess, events: list[tuple[str, bytes]]) -> int:
    nc = await nats_io.connect(server.url, "berth-bench", server.admin_creds())
    js = nc.jetstream()
    await nats_io.ensure_streams(js)
    # Plain publishes from one connection keep their order; the stream stores them all as
    # long as its ingest queue is not overrun (a loaded server drops what overflows it):
    # a flush, a round trip, every 1,000 keeps it short.
    for i, (subject, data) in enumerate(events):
        await nc.publish(subject, data)
        if i % 1000 == 0:
            await nc.flush()
    await nc.flush()
    deadline = time.monotonic() + 120
    while (last := await nats_io.last_event_seq(js)) < len(events):
        if time.monotonic() > deadline:
            raise SystemExit(f"the stream holds {last} of {len(events)} events")
        await asyncio.sleep(0.2)
    await nc.close()
    return last


def start_dashboard(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as f:
        return subprocess.Popen(service_command("dashboard"), env=env,
                                stdout=f, stderr=subprocess.STDOUT)


def profile_top(raw: Path, top: int = 25) -> str:
    """py-spy's collapsed stacks ("a;b;c count" lines) summed per function: the `top` by
    own time and by time including callees, in % of the samples."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        samples += n
        # "func (path/file.py:line)" -> "func file.py": one entry per function.
        frames = [f.split(" (")[0] + " " + f.rsplit("/", 1)[-1].rsplit(":", 1)[0]
                  for f in stack.split(";")]
        own[frames[-1]] += n
        for frame in set(frames):
            total[frame] += n
    lines = [f"{samples} samples"]
    for title, counter in (("own time", own), ("including callees", total)):
        lines.append(f"\n-- {title} --")
        lines += [f"{100 * n / max(samples, 1):5.1f}%  {name}"
                  for name, n in counter.most_common(top)]
    return "\n".join(lines) + "\n"


def start_profiler(pid: int, out: Path) -> subprocess.Popen[bytes]:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen([py_spy, "record", "--pid", str(pid), "--format", "raw",
                             "--rate", "200", "--nonblocking", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def catch_up(env: dict[str, str], client: httpx.Client, last: int, log: Path,
             profile: Path | None = None) -> tuple[subprocess.Popen[bytes], dict[str, float]]:
    """Starts a dashboard with no snapshot and waits until it has folded the whole stream:
    the running process, and its events/s, wall and CPU seconds."""
    started = time.monotonic()
    proc = start_dashboard(env, log)
    profiler = None
    if profile is not None:
        profiler = start_profiler(proc.pid, profile.with_suffix(".raw"))
    cold = wait_caught_up(client, last, proc)
    cpu = cpu_seconds(proc.pid)
    if profiler is not None and profile is not None:
        profiler.send_signal(2)  # SIGINT: py-spy writes what it sampled and exits
        profiler.wait(60)
        profile.write_text(profile_top(profile.with_suffix(".raw")))
    folded = last - cold["first_seq"]
    wall = cold["done"] - started
    # A history folded in one batch (--quick) is never seen half done: then the rate is
    # over the whole wall time, start-up included.
    rate = (folded / max(cold["done"] - cold["first"], 1e-9) if folded > 0
            else last / max(wall, 1e-9))
    return proc, {"events_per_s": rate, "wall_s": wall, "cpu_s": cpu}


def wait_caught_up(client: httpx.Client, last: int, proc: subprocess.Popen[bytes]
                   ) -> dict[str, float]:
    """Polls /healthz; returns when the first event was seen folded and when all were."""
    first_seen: tuple[float, int] | None = None
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the dashboard exited with {proc.returncode}")
        try:
            health = client.get("/healthz").json()
        except httpx.HTTPError:
            time.sleep(0.05)
            continue
        now = time.monotonic()
        seq = health["events_seq"]
        if first_seen is None and seq > 0:
            first_seen = (now, seq)
        if seq >= last and health["caught_up"]:
            assert first_seen is not None
            return {"done": now, "first": first_seen[0], "first_seq": first_seen[1]}
        time.sleep(0.05)


def latencies(client: httpx.Client, paths: list[str]) -> dict[str, float]:
    times = []
    for path in paths:
        t0 = time.perf_counter()
        resp = client.get(path)
        times.append((time.perf_counter() - t0) * 1000)
        resp.raise_for_status()
    times.sort()
    return {"p50_ms": round(statistics.median(times), 2),
            "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))], 2),
            "requests": len(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--tasks-per-job", type=int, default=100)
    parser.add_argument("--requests", type=int, default=300, help="per kind of request")
    parser.add_argument("--only-catchup", action="store_true",
                        help="measure the catch-up from sequence 0 only")
    parser.add_argument("--runs", type=int, default=1, help="catch-ups (with --only-catchup)")
    parser.add_argument("--profile", type=Path, help="a folder for py-spy profiles")
    parser.add_argument("--quick", action="store_true",
                        help="1,000 tasks, 10 requests of each kind, no restart (CI)")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.tasks_per_job, args.requests = 1000, 100, 10
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="berth-bench-") as tmp:
        data = Path(tmp)
        nats_server = servers.start_nats(data)
        proc: subprocess.Popen[bytes] | None = None
        try:
            t0 = time.monotonic()
            events = history(args.tasks, args.tasks_per_job)
            last = asyncio.run(fill_stream(nats_server, events))
            print(f"wrote {last} events in {time.monotonic() - t0:.1f} s", file=sys.stderr)

            port = servers.free_port()
            env = servers.service_env(nats_server.url, "redis://127.0.0.1:1/0", data,
                                      BERTH_API_PORT=str(port), BERTH_LOG_LEVEL="WARNING",
                                      # start_nats made the service identities.
                                      BERTH_NATS_CREDS=str(
                                          AuthDir.of(data).creds_path("dashboard")))
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
            log = data / "dashboard.log"

            if args.only_catchup:
                for run in range(args.runs):
                    profile = (args.profile / f"catchup-{run + 1}.txt"
                               if args.profile is not None else None)
                    proc, cold = catch_up(env, client, last, log, profile)
                    proc.terminate()
                    proc.wait(30)
                    proc = None
                    shutil.rmtree(data / "dashboard", ignore_errors=True)
                    print(json.dumps({
                        "bench": "dashboard_catchup", "events": last,
                        "catch_up_events_per_s": round(cold["events_per_s"]),
                        "cold_start_to_caught_up_s": round(cold["wall_s"], 2),
                        "dashboard_cpu_s": round(cold["cpu_s"], 2),
                        "cpu_us_per_event": round(cold["cpu_s"] / last * 1e6, 1),
                        "loadavg_1m": os.getloadavg()[0]}), flush=True)
                return

            proc, cold = catch_up(env, client, last, log, args.profile and
                                  args.profile / "catchup-1.txt")
            rate = cold["events_per_s"]
            cold_wall = cold["wall_s"]
            rss_after_catch_up = status_mib(proc.pid, "VmRSS")

            jobs = client.get("/api/jobs?limit=1000").json()["jobs"]
            ids = [j["job_id"] for j in jobs]
            rng = random.Random(7)
            n = args.requests
            results = {
                "list_page_50": latencies(client, ["/api/jobs?limit=50"] * n),
                "list_filtered": latencies(client, [
                    f"/api/jobs?limit=50&name_prefix=sweep-{rng.randrange(10)}"
                    f"&user=user{rng.randrange(7)}&state=succeeded" for _ in range(n)]),
                "list_deep_page": latencies(client, [
                    f"/api/jobs?limit=50&cursor={rng.randrange(2, len(ids) + 1)}"
                    for _ in range(n)]),
                "job_detail": latencies(client, [
                    f"/api/jobs/{rng.choice(ids)}" for _ in range(n)]),
                "task_detail": latencies(client, [
                    f"/api/jobs/{rng.choice(ids)}/tasks/{rng.randrange(args.tasks_per_job)}"
                    for _ in range(n)]),
            }
            rss_after_requests = status_mib(proc.pid, "VmRSS")

            # A clean stop saves the snapshot; the restart loads it and resumes the consumer.
            proc.terminate()
            proc.wait(30)
            snapshot = data / "dashboard" / "projection.snapshot"
            warm_wall: float | None = None
            if not args.quick:  # CI's budget; tests/test_projection.py restarts from one
                started = time.monotonic()
                proc = start_dashboard(env, log)
                warm = wait_caught_up(client, last, proc)
                warm_wall = warm["done"] - started

            report = {
                "bench": "dashboard",
                "tasks": args.tasks,
                "jobs": len(ids) if len(ids) < 1000 else args.tasks // args.tasks_per_job,
                "events": last,
                "catch_up_events_per_s": round(rate),
                "cold_start_to_caught_up_s": round(cold_wall, 2),
                "dashboard_cpu_s": round(cold["cpu_s"], 2),
                "snapshot_mib": round(snapshot.stat().st_size / 2**20, 1),
                "restart_from_snapshot_s": warm_wall and round(warm_wall, 2),
                "rss_mib": round(max(rss_after_catch_up, rss_after_requests)),
                **{f"{kind}_{k}": v for kind, r in results.items() for k, v in r.items()
                   if k != "requests"},
                "requests_per_kind": n,
                "cpus": os.cpu_count(),
            }
            print(json.dumps(report))
            print(f"\n{'request':<16}{'p50 ms':>10}{'p99 ms':>10}", file=sys.stderr)
            for kind, r in results.items():
                print(f"{kind:<16}{r['p50_ms']:>10}{r['p99_ms']:>10}", file=sys.stderr)
            print(f"catch-up {rate:,.0f} events/s ({last:,} events, cold start to caught up "
                  f"{cold_wall:.1f} s); restart from a {report['snapshot_mib']} MiB snapshot "
                  f"{warm_wall or 0:.1f} s; RSS {report['rss_mib']} MiB", file=sys.stderr)
        finally:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)
            nats_server.stop()


if __name__ == "__main__":
    main()
