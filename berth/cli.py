"""The `berth` command."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import signal
import sys
import time
import uuid
from importlib import resources
from pathlib import Path
from typing import Any

from berth import backup, creds_cli, health, node_cli, token_cli, workspace
from berth.client import (
    ApiError,
    SubmitOutcome,
    api_fetch,
    api_get,
    cancel_job,
    load_spec_file,
    publish_submit,
    wait_for_outcome,
)
from berth.creds_cli import cli_connection, cli_credentials
from berth.stack_info import nats_url, read_stack_info
from shared import config, subjects
from shared.config import RedisSettings, parse_sentinels
from shared.credentials import Credentials
from shared.dir_lock import DirLocked
from shared.messages import decode, job_spec_decoder, job_spec_schema
from shared.states import JOB_TERMINAL_NAMES, JobState

TERMINAL = JOB_TERMINAL_NAMES


def _urls(args: argparse.Namespace) -> tuple[str, str]:
    """NATS and API URLs: flags, then BERTH_* variables, then a running `berth up`."""
    api_url = args.api_url or config.cli_api_url() or str(
        read_stack_info(args.data_dir).get("api_url", "http://127.0.0.1:8080"))
    return nats_url(args.nats_url, args.data_dir), api_url


# --- commands ------------------------------------------------------------------------------


def cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(job_spec_schema(), indent=2))
    return 0


def submit_msg_id(user: str | None, key: str, payload: bytes) -> str:
    """The submit's dedup id: the same spec submitted again with the same key (a retry) is
    the same message to JetStream, so it cannot become a second job (within the submit
    stream's 10-minute dedup window)."""
    digest = hashlib.sha256(b"\0".join([(user or "").encode(), key.encode(), payload]))
    return f"submit:{digest.hexdigest()[:40]}"


async def _submit(nats_url: str, creds: Credentials, payload: bytes, key: str | None = None,
                  timeout: float = 120) -> SubmitOutcome:
    """Submits and waits for the verdict. A submit that was stored but not yet decided (a
    submitter that died holding it is redelivered after 30 s) is waited for, with a word
    on progress, not raced against a short timeout."""
    key = key or uuid.uuid4().hex
    async with cli_connection(nats_url, creds) as nc:
        try:
            seq = await publish_submit(nc, payload, submit_msg_id(creds.user, key, payload),
                                       subject=subjects.submit_job(creds.user))
        except Exception as exc:
            raise SystemExit(f"berth: the submit was not stored ({exc.__class__.__name__}: "
                             f"{exc}); retry with --idempotency-key {key}") from None
        try:
            return await asyncio.wait_for(wait_for_outcome(nc, seq, creds.user, 5), 5)
        except TimeoutError:
            print(f"submit {seq} stored; waiting for the submitter's verdict ...",
                  file=sys.stderr)
        try:
            return await wait_for_outcome(nc, seq, creds.user, max(timeout - 5, 1))
        except TimeoutError:
            raise SystemExit(
                f"berth: submit {seq} was stored but no verdict came within {timeout:g}s (is "
                f"the submitter running?); it will still be decided. To retry without "
                f"making a second job: --idempotency-key {key}") from None


async def _resolve(nats_url: str, data_dir: str, payload: bytes, base: Path) -> bytes:
    """`workspace` and `env_file` resolved: a bad one is said before anything connects."""
    return await workspace.resolve(
        payload, base, lambda: cli_connection(nats_url, cli_credentials(data_dir)),
        lambda line: print(line, file=sys.stderr))


def cmd_submit(args: argparse.Namespace) -> int:
    nats_url, api_url = _urls(args)
    try:
        payload = load_spec_file(args.file)
        payload = workspace.with_workspace(payload, args.workspace)
    except (OSError, ValueError) as exc:
        print(f"berth: {exc}", file=sys.stderr)
        return 2
    if workspace.needs_resolving(payload):
        base = Path.cwd() if args.file == "-" else Path(args.file).resolve().parent
        try:
            payload = asyncio.run(_resolve(nats_url, args.data_dir, payload, base))
        except ValueError as exc:
            print(f"berth: {exc}", file=sys.stderr)
            return 2
    outcome = asyncio.run(_submit(nats_url, cli_credentials(args.data_dir), payload,
                                  args.idempotency_key, args.submit_timeout))
    if not outcome.accepted:
        print(f"rejected: {outcome.reason}", file=sys.stderr)
        return 1
    print(outcome.job_id)
    waits = _waits_for(payload)
    if waits:  # stdout stays the job id alone, for scripts
        print(f"job {outcome.job_id} waits for {waits}", file=sys.stderr)
    if retry := _retry_words(payload):
        print(f"job {outcome.job_id} {retry}", file=sys.stderr)
    if args.wait:
        return _wait_and_show(api_url, str(outcome.job_id), args.timeout)
    return 0


def _waits_for(payload: bytes) -> str:
    """The dependencies an accepted submit waits for, in words ("" for none)."""
    spec = json.loads(payload)  # the submitter accepted it: a valid spec
    parts = [f"{', '.join(spec['after'])} to succeed"] if spec.get("after") else []
    parts += [f"{', '.join(spec['after_any'])} to end"] if spec.get("after_any") else []
    return " and ".join(parts)


def _retry_words(payload: bytes) -> str:
    """What an accepted submit's retry policy will do, in words ("" without one)."""
    spec = decode(job_spec_decoder, payload)  # the submitter accepted it: a valid spec
    return spec.retry.describe() if spec.retry is not None else ""


def _clock(ts: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "-"


def _format_attempt(a: dict[str, Any]) -> str:
    line = f"    attempt {a['attempt_id']:<3} {a['worker_id']:<14} {a['state']}"
    if a["worker_failure"]:
        line += " (worker failure)"
    if a["exit_code"] is not None:
        line += f", exit code {a['exit_code']}"
    first, _, rest = str(a["error"] or "").partition("\n")
    if first:
        line += f", {first}"
    if a.get("devices"):
        line += f", devices {','.join(str(d) for d in a['devices'])}"
    if gpu := a.get("gpu"):
        line += f", GPU memory peak {gpu['peak_memory_mb']} MiB"
        if gpu["mean_utilization"] is not None:
            line += (f", utilisation mean {gpu['mean_utilization']:.0f}% "
                     f"peak {gpu['peak_utilization']}%")
    if usage := a.get("usage"):
        line += f", cpu {usage['cpu_seconds']:g}s, peak RSS {usage['peak_rss_mb']:g} MiB"
    span = f"assigned {_clock(a['assigned_at'])}"
    if a["started_at"]:
        span += f", started {_clock(a['started_at'])}"
    if a["finished_at"]:
        span += f", ended {_clock(a['finished_at'])}"
    # An error's further lines (a failed build's output tail) go below, indented.
    return "\n".join([f"{line}  [{span}]", *(f"      | {x}" for x in rest.splitlines())])


def _format_job(job: dict[str, Any]) -> str:
    lines = [f"job {job['job_id']} ({job['name']}): {job['state']}"]
    if job.get("error"):
        lines.append(f"  error: {job['error'].partition(chr(10))[0]}")
    if job.get("failure_reason"):
        lines.append(f"  failure_reason: {job['failure_reason']}")
    if job.get("waiting_for"):
        lines.append(f"  waiting for: {job['waiting_for']}")
    if job.get("parent"):
        lines.append(f"  parent: {job['parent']}")
    if job.get("children"):
        lines.append(f"  children: {', '.join(job['children'])}")
    for task in job["tasks"]:
        line = f"  task {task['index']}: {task['state']}"
        # Set only while the task waits: to be placed (pending), or on its worker (assigned).
        if task["pending_reason"]:
            line += f"  (waiting: {task['pending_reason']})"
        elif task["error"]:
            line += f"  ({task['error'].partition(chr(10))[0]})"
        lines.append(line)
        lines += [_format_attempt(a) for a in task["attempts"]]
        lines += [f"    refused report: {why}" for why in task["refused_reports"]]
    return "\n".join(lines)


def _wait_for_end(api_url: str, job_id: str, timeout: float) -> dict[str, Any] | None:
    """Polls the job until it ends, printing its task counts as they change; returns the
    ended job, or None (after saying why) on an error or timeout."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            job: dict[str, Any] = api_get(api_url, f"/api/jobs/{job_id}")
        except ApiError as exc:
            if "404" not in str(exc) or time.monotonic() > deadline:
                print(f"berth: {exc}", file=sys.stderr)
                return None
            time.sleep(0.2)
            continue
        summary = " ".join(f"{n} {s}" for s, n in sorted(job["task_counts"].items()))
        if summary != last:
            print(f"  {job['state']}: {summary}", file=sys.stderr)
            last = summary
        if job["state"] in TERMINAL:
            print(_format_job(job))
            return job
        if time.monotonic() > deadline:
            print(f"berth: job {job_id} still {job['state']} after {timeout:.0f}s",
                  file=sys.stderr)
            return None
        time.sleep(0.2)


def _wait_and_show(api_url: str, job_id: str, timeout: float) -> int:
    """Exit status 0 when the job succeeded."""
    job = _wait_for_end(api_url, job_id, timeout)
    return 0 if job is not None and job["state"] == JobState.SUCCEEDED.display else 1


def cmd_status(args: argparse.Namespace) -> int:
    _, api_url = _urls(args)
    try:
        if args.job is None:
            page = api_get(api_url, "/api/jobs?limit=100")
            for job in page["jobs"]:
                counts = " ".join(f"{n} {s}" for s, n in sorted(job["task_counts"].items()))
                print(f"{job['job_id']:<16} {job['name']:<24} {job['state']:<14} {counts}")
            if page["next_cursor"]:
                print("(the 100 newest jobs; see /api/jobs?cursor=... for older ones)")
        else:
            print(_format_job(api_get(api_url, f"/api/jobs/{args.job}")))
    except ApiError as exc:
        print(f"berth: {exc}", file=sys.stderr)
        return 1
    return 0


def _format_worker(w: dict[str, Any]) -> list[str]:
    res = w["resources"]
    device = res["device"]
    offer = f"{res['cpu']:g} cpu, {res['memory_mb']} MiB"
    if device["type"] != "cpu":
        offer += f", {device['count']} {device['type']}:{device['variant']}"
    state = "healthy" if w["healthy"] else "unhealthy"
    lines = [f"{w['worker_id']:<16} {state:<9} {offer}  "
             f"({len(w['running_attempts'])} running, {w['cpu_free']:g} cpu free, "
             f"{w['devices_free']} devices free)"]
    if away := w.get("out_of_service"):
        if w.get("drain_deadline"):
            away += f" (deadline {_clock(w['drain_deadline'])})"
        lines.append(f"  OUT OF SERVICE: {away}")
    for d in w.get("devices", []):
        what = " ".join(x for x in (d["uuid"], d["model"],
                                    f"{d['memory_mb']} MiB" if d["memory_mb"] else "") if x)
        state = f"held by {d['held_by']}" if d["held_by"] else "free"
        now = [f"{d[k]}{unit}" for k, unit in (("utilization", "% busy"),
                                                ("memory_used_mb", " MiB used"),
                                                ("temperature_c", " C"))
               if d.get(k) is not None]
        if now:
            state += f" ({', '.join(now)})"
        if d.get("unhealthy"):
            state += f", UNHEALTHY: {d['unhealthy']}"
        lines.append(f"  device {d['index']}: {what or 'unchecked'}  {state}")
    return lines


def cmd_workers(args: argparse.Namespace) -> int:
    _, api_url = _urls(args)
    try:
        workers = api_get(api_url, "/api/workers")
    except ApiError as exc:
        print(f"berth: {exc}", file=sys.stderr)
        return 1
    for w in workers:
        print("\n".join(_format_worker(w)))
    return 0


async def _device_health(nats_url: str, creds: Credentials, worker_id: str, index: int,
                         healthy: bool, reason: str) -> None:
    from shared import nats_io
    from shared.messages import DeviceHealthChanged

    async with cli_connection(nats_url, creds) as nc:
        await nats_io.publish_event(
            nc.jetstream(), subjects.worker_events(worker_id),
            DeviceHealthChanged(worker_id=worker_id, index=index, healthy=healthy,
                                reason=reason, ts=time.time()),
            msg_id=f"device:{worker_id}:{index}:{uuid.uuid4().hex}")


def cmd_device(args: argparse.Namespace) -> int:
    """An operator takes a worker's device out of service or returns it (an admin's
    identity: it speaks on the worker's own event subject)."""
    nats_url, api_url = _urls(args)
    try:
        worker = api_get(api_url, f"/api/workers/{args.worker}")
    except ApiError as exc:
        print(f"berth: worker {args.worker}: {exc}", file=sys.stderr)
        return 1
    indices = [d["index"] for d in worker.get("devices", [])]
    if args.index not in indices:
        print(f"berth: index: worker {args.worker} has no device {args.index} (it has "
              f"{', '.join(map(str, indices)) or 'none'})", file=sys.stderr)
        return 1
    healthy = args.action == "enable"
    reason = args.reason or ("" if healthy else "taken out of service by an operator")
    asyncio.run(_device_health(nats_url, cli_credentials(args.data_dir, admin=True),
                               args.worker, args.index, healthy, reason))
    print(f"device {args.index} of {args.worker} "
          f"{'returned to service' if healthy else 'takes no new attempts'}")
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    from shared.messages import NodeAction

    deadline = args.deadline if args.command == "drain" else None
    return node_cli.node_health(*_urls(args), args.data_dir, args.worker,
                                NodeAction(args.command), args.reason, deadline)


async def _cancel(nats_url: str, creds: Credentials, job_id: str, reason: str
                  ) -> SubmitOutcome:
    async with cli_connection(nats_url, creds) as nc:
        return await cancel_job(nc, job_id, reason, creds.user)


def _ended(api_url: str, job_id: str) -> str | None:
    """The state of the job if the dashboard knows it has ended; None if it has not, or
    the dashboard cannot say (the cancel then goes ahead: the submitter decides)."""
    try:
        job = api_get(api_url, f"/api/jobs/{job_id}")
    except ApiError:
        return None
    state = job.get("state") if isinstance(job, dict) else None
    return state if state in TERMINAL else None


def cmd_cancel(args: argparse.Namespace) -> int:
    nats_url, api_url = _urls(args)
    # Cancelling a job that already ended changes nothing: say so, and fail, rather than
    # report a cancel that did not happen.
    if (state := _ended(api_url, args.job)) is not None:
        print(f"berth: job {args.job} already ended ({state}); nothing to cancel",
              file=sys.stderr)
        return 1
    creds = cli_credentials(args.data_dir)
    outcome = asyncio.run(_cancel(nats_url, creds, args.job, args.reason))
    if not outcome.accepted:
        print(f"rejected: {outcome.reason}", file=sys.stderr)
        return 1
    print(f"cancelling {args.job} (request {outcome.submit_seq})", file=sys.stderr)
    if args.wait and _wait_for_end(api_url, args.job, args.timeout) is None:
        return 1
    return 0


async def _doctor(nats_url: str, creds: Credentials, redis: RedisSettings) -> Any:
    from shared import redis_io
    from shared.checker import check_cluster
    from shared.reservations import ReservationStore

    async with cli_connection(nats_url, creds) as nc:
        client = redis_io.open_client(redis)
        try:
            return await check_cluster(nc.jetstream(), ReservationStore(client))
        finally:
            await client.aclose()


def doctor_redis(args: argparse.Namespace) -> RedisSettings:
    """Where and as whom `berth doctor` reads Redis: --redis-url, then BERTH_REDIS_URL (with
    BERTH_REDIS_SENTINELS), else beside a running `berth up`: its Redis (or Sentinels) as
    the read-only `doctor` user, whose password is in <data dir>/auth/redis.json."""
    from shared import redis_auth

    explicit = args.redis_url or RedisSettings.url_from_env()
    if explicit:
        return RedisSettings.from_env(explicit)
    info = read_stack_info(args.data_dir)
    url = info.get("redis_url", "redis://127.0.0.1:6379/0")
    if redis_auth.RedisUsers.path_of(args.data_dir).exists():
        users = redis_auth.RedisUsers.load(args.data_dir)
        url = redis_auth.with_user(url, redis_auth.DOCTOR, users.passwords[redis_auth.DOCTOR])
    settings = RedisSettings.from_env(url)
    if not settings.sentinels and info.get("redis_sentinels"):
        settings = dataclasses.replace(
            settings, sentinels=parse_sentinels(info["redis_sentinels"], "stack.json"),
            master=info.get("redis_master", settings.master))
    return settings


def cmd_doctor(args: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    from shared import redis_auth, redis_io

    nats_url, _ = _urls(args)
    try:
        redis = doctor_redis(args)
    except redis_auth.RedisAuthError as exc:
        print(f"berth doctor: {exc}", file=sys.stderr)
        return 2
    where = redis_auth.redact(redis.url)
    if redis.sentinels:
        where += f" (primary {redis.master!r} from Sentinel " + ",".join(
            f"{h}:{p}" for h, p in redis.sentinels) + ")"
    print(f"checking placement invariants (events and {where}) ...", file=sys.stderr)
    try:
        report = asyncio.run(_doctor(nats_url, cli_credentials(args.data_dir, admin=True),
                                     redis))
    except (redis_io.RedisConfigError, RedisError) as exc:
        print(f"berth doctor: Redis at {where}: {exc}", file=sys.stderr)
        return 2
    for line in report.violations():
        print(f"VIOLATION {line}")
    print(f"events_seq={report.events_seq}")
    print(f"refused_double_bookings={report.refused_double_bookings}")
    print(f"refused_events={report.refused_events} (last at {report.last_refused_seq})")
    print(f"double_booked_hosts={report.double_booked_hosts}")
    print(f"double_booked_ports={report.double_booked_ports}")
    print(f"double_booked_devices={report.double_booked_devices}")
    print(f"violations={len(report.violations())}")
    return 0 if report.ok else 1


async def _leader_lease(redis: RedisSettings) -> tuple[str | None, int]:
    """The leader key and its TTL in ms (negative when absent), as `berth doctor` reads."""
    from shared import redis_io, redis_keys

    client = redis_io.open_client(redis)
    try:
        lease = await client.get(redis_keys.LEADER)
        ttl: int = await client.pttl(redis_keys.LEADER)
        # decode_responses: a str, or None when no one holds the lease.
        return None if lease is None else str(lease), ttl
    finally:
        await client.aclose()


def _healthz(api_url: str) -> tuple[int | None, Any, str]:
    """The dashboard's /healthz: status code and body, a 503 included (catching up)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(api_url.rstrip("/") + "/healthz", timeout=5) as resp:
            return resp.status, json.loads(resp.read()), ""
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read()), ""
        except ValueError:
            return exc.code, None, f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return None, None, f"{api_url}: {exc}"


def cmd_health(args: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    from shared import redis_auth, redis_io

    _, api_url = _urls(args)
    verdicts: list[health.Verdict] = []
    try:
        redis = doctor_redis(args)
        lease, ttl = asyncio.run(asyncio.wait_for(_leader_lease(redis), 10))
        verdicts.append(health.scheduler(lease, ttl))
    except (redis_auth.RedisAuthError, redis_io.RedisConfigError, RedisError, OSError,
            TimeoutError) as exc:
        verdicts.append(health.Verdict("scheduler", False, f"cannot read the lease: {exc}"))
    verdicts.append(health.dashboard(*_healthz(api_url)))
    try:
        verdicts += health.workers(api_get(api_url, "/api/workers"), time.time())
    except ApiError as exc:
        verdicts.append(health.Verdict("workers", False, str(exc)))
    if (stack := health.children(read_stack_info(args.data_dir))) is not None:
        verdicts.append(stack)
    for verdict in verdicts:
        print(verdict.line())
    return 0 if all(v.ok for v in verdicts) else 1


def cmd_run(args: argparse.Namespace) -> int:
    sys.argv = [f"berth run {args.service}", *args.rest]
    if args.service == "worker":
        from services.worker_agent.service import main as worker_main

        worker_main(args.rest)
        return 0
    if args.rest:
        print(f"berth run {args.service} takes no arguments (configure with BERTH_* variables)",
              file=sys.stderr)
        return 2
    from services.dashboard_api.service import main as dashboard_main
    from services.scheduler.service import main as scheduler_main
    from services.submitter.service import main as submitter_main

    {"scheduler": scheduler_main, "submitter": submitter_main,
     "dashboard": dashboard_main}[args.service]()
    return 0


def _start(args: argparse.Namespace) -> Any:
    from berth.stack import start_stack

    data_dir = Path(args.data_dir).resolve()
    print(f"starting berth in {data_dir} ...", file=sys.stderr)
    try:
        stack = start_stack(
            data_dir, workers=args.workers, worker_cpu=args.worker_cpu,
            worker_memory_mb=args.worker_memory_mb, api_port=args.port,
            nats_port=args.nats_port, redis_port=args.redis_port,
            prefer_redis_on_path=args.redis_server, nats_nodes=args.nats_nodes,
        )
    except DirLocked as exc:
        raise SystemExit(f"berth: {exc}") from None
    nodes = len(stack.nats.nodes)
    if nodes > 1:
        print(f"  NATS       {nodes} nodes, streams with {stack.nats.stream_replicas} "
              "replicas (docs/nats-cluster.md)", file=sys.stderr)
    print(f"  NATS       {stack.nats.url}\n"
          f"  Redis      {stack.redis.url} (users: {data_dir / 'auth' / 'redis.json'})\n"
          f"  dashboard  {stack.api_url}/\n  workers    {args.workers}\n"
          f"  logs       {data_dir / 'logs'}\n"
          f"  identities {stack.auth.path} (`berth creds --help`)\n"
          f"  API token  {data_dir / 'api-token'} (for submit and cancel over HTTP)",
          file=sys.stderr)
    return stack


def cmd_up(args: argparse.Namespace) -> int:
    from shared.servers import ServerError

    stack = _start(args)
    print("berth is up; a child that exits is started again; Ctrl-C stops every process "
          "it started.", file=sys.stderr)
    stopping = False
    code = 0

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        while not stopping:
            for line in stack.supervise():
                print(f"{time.strftime('%H:%M:%S')} berth: {line}", file=sys.stderr)
            time.sleep(0.5)
    except ServerError as exc:
        print(f"berth: {exc}; stopping", file=sys.stderr)
        code = 1
    finally:
        print("stopping ...", file=sys.stderr)
        stack.stop()
    return code


def cmd_demo(args: argparse.Namespace) -> int:
    stack = _start(args)
    try:
        demo = resources.files("berth").joinpath("examples", "demo.yaml")
        with resources.as_file(demo) as path:
            payload = load_spec_file(str(path))
        print("submitting the demo job (3 replicas) ...", file=sys.stderr)
        outcome = asyncio.run(_submit(stack.nats.url, cli_credentials(str(stack.data_dir)),
                                      payload))
        if not outcome.accepted:
            print(f"rejected: {outcome.reason}", file=sys.stderr)
            return 1
        print(f"job {outcome.job_id} accepted", file=sys.stderr)
        code = _wait_and_show(stack.api_url, str(outcome.job_id), args.timeout)
        try:
            job = api_get(stack.api_url, f"/api/jobs/{outcome.job_id}")
            for task in job["tasks"]:
                logs = f"/api/jobs/{outcome.job_id}/tasks/{task['index']}/logs"
                output = api_fetch(stack.api_url, logs).decode(errors="replace").strip()
                print(f"  task {task['index']} output: {output}")
        except ApiError as exc:
            print(f"berth: could not read logs: {exc}", file=sys.stderr)
        return code
    finally:
        print("stopping ...", file=sys.stderr)
        stack.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="berth",
        description="berth: a cluster job scheduler. Start a local cluster with `berth up`, "
        "submit with `berth submit job.yaml`, watch with `berth status`.",
    )
    parser.add_argument("--data-dir", default=config.cli_data_dir(),
                        help="where `berth up` keeps NATS/Redis data and logs (default: .berth)")
    parser.add_argument("--nats-url", help="NATS URL, or several comma-separated (default: "
                        "$BERTH_NATS_URL or `berth up`'s)")
    parser.add_argument("--api-url", help="dashboard API URL (default: $BERTH_API_URL or "
                        "`berth up`'s)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def stack_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--workers", type=int, default=2, help="local workers (default: 2)")
        p.add_argument("--worker-cpu", type=float, default=2.0,
                       help="cpu cores each local worker offers (default: 2)")
        p.add_argument("--worker-memory-mb", type=int, default=2048,
                       help="memory each local worker offers, MiB (default: 2048)")
        p.add_argument("--port", type=int, default=None,
                       help="dashboard port (default: a free port)")
        p.add_argument("--nats-port", type=int, default=None,
                       help="default: a free port (with --nats-nodes: the first node's)")
        p.add_argument("--nats-nodes", type=int, default=1, metavar="N",
                       help="run NATS as a JetStream cluster of N nodes on loopback, streams "
                       "with min(N, 3) replicas (default: 1, one server)")
        p.add_argument("--redis-port", type=int, default=None, help="default: a free port")
        p.add_argument("--redis-server", action="store_true",
                       help="use redis-server from PATH instead of the bundled valkey-server")

    p = sub.add_parser("up", help="start NATS, Redis, all services and local workers")
    stack_options(p)
    p.set_defaults(func=cmd_up)
    p = sub.add_parser("demo", help="start berth, run a demo job to completion, stop")
    stack_options(p)
    p.add_argument("--timeout", type=float, default=120, help="seconds to wait (default: 120)")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("submit", help="submit a job spec file (YAML or JSON)")
    p.add_argument("file", help="the spec: a .json file is JSON, any other YAML 1.2; - reads "
                   "standard input (JSON if it parses as JSON, else YAML)")
    p.add_argument("--wait", action="store_true", help="wait until the job finishes")
    p.add_argument("--timeout", type=float, default=3600, help="with --wait (default: 3600 s)")
    p.add_argument("--idempotency-key", default=None, metavar="KEY",
                   help="a key that makes a retry of this same submit the same submit (not a "
                   "second job) for 10 minutes; printed when a submit's fate is unknown")
    p.add_argument("--submit-timeout", type=float, default=120,
                   help="seconds to wait for the submitter's verdict (default: 120)")
    p.add_argument("--workspace", default=None, metavar="DIR",
                   help="pack DIR (honouring .gitignore and .berthignore) into a bundle each "
                   "task runs in, as the spec's `workspace` does (docs/workspaces.md)")
    p.set_defaults(func=cmd_submit)
    p = sub.add_parser(
        "cancel", help="cancel a job: kill its unfinished tasks, cancel its children",
        description="Cancel a job. Its unfinished tasks are killed (SIGTERM, then SIGKILL "
        "after BERTH_KILL_GRACE seconds) and its child jobs are cancelled. Cancelling a job "
        "that already ended changes nothing: berth says so and exits with status 1.")
    p.add_argument("job", help="job id, e.g. j42-1a2b")
    p.add_argument("--reason", default="", help="recorded with the job's error")
    p.add_argument("--wait", action="store_true", help="wait until the job has ended")
    p.add_argument("--timeout", type=float, default=120, help="with --wait (default: 120 s)")
    p.set_defaults(func=cmd_cancel)
    p = sub.add_parser("status", help="show one job with its tasks, or list all jobs")
    p.add_argument("job", nargs="?")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("workers", help="list the workers, their resources and devices (GPUs)")
    p.set_defaults(func=cmd_workers)
    p = sub.add_parser(
        "device", help="take a worker's device (GPU) out of service, or return it",
        description="disable: no new attempt is placed on the device, and the one running "
        "on it is killed and retried elsewhere (a worker failure, not the user's). "
        "enable: return a device to service, e.g. one its worker reported unhealthy (NVML "
        "errors, uncorrectable ECC errors, gone from the bus) once it is fixed.")
    p.add_argument("action", choices=["enable", "disable"])
    p.add_argument("worker", help="worker id")
    p.add_argument("index", type=int, help="the device's index (`berth workers` lists them)")
    p.add_argument("--reason", default="", help="recorded with a disable")
    p.set_defaults(func=cmd_device)
    for name, text in (
            ("cordon", "the worker takes no new work; what runs there runs on"),
            ("drain", "the worker takes no new work; what still runs there at the deadline "
                      "is preempted (retried elsewhere)"),
            ("uncordon", "return a cordoned, drained or quarantined worker to service")):
        p = sub.add_parser(name, help=text, description=text + " (docs/operations.md).")
        p.add_argument("worker", help="worker id (`berth workers` lists them)")
        p.add_argument("--reason", default="", help="recorded in the event log")
        if name == "drain":
            p.add_argument("--deadline", type=float, default=node_cli.DEFAULT_DRAIN_DEADLINE,
                           help="seconds to wait for running work (default: %(default)g)")
        p.set_defaults(func=cmd_node)
    p = sub.add_parser(
        "doctor", help="check the placement invariants from Redis and the event log",
        description="Reads Redis and the event log and reports every violation of the "
        "placement invariants: over-committed hosts, a group held by two gangs, a host shared "
        "by two gangs, a port given twice, a device (GPU) given to two live attempts, reservations "
        "with no live attempt, live attempts with no reservation. Prints double_booked_hosts=0, "
        "double_booked_ports=0 and double_booked_devices=0 when all is well (ports are counted "
        "per host address, devices per worker); exit status 1 "
        "when anything is wrong.")
    p.add_argument("--redis-url", help="Redis URL with the doctor user's credentials "
                   "(default: $BERTH_REDIS_URL, else `berth up`'s, as its doctor user)")
    p.set_defaults(func=cmd_doctor)
    p = sub.add_parser(
        "health", help="one line per service: leading, caught up, heartbeating",
        description="Whether the scheduler holds the leader lease (and its epoch), the "
        "dashboard has caught up with the event log, and each worker heartbeats; beside a "
        "running `berth up`, also how often it restarted its children. Exit status 1 when "
        "anything is unhealthy.")
    p.add_argument("--redis-url", help="as for `berth doctor`")
    p.set_defaults(func=cmd_health)
    creds_cli.add_parser(sub)
    backup.add_parsers(sub)
    token_cli.add_parser(sub)
    p = sub.add_parser("schema", help="print the JSON Schema of the submit message")
    p.set_defaults(func=cmd_schema)
    p = sub.add_parser("run", help="run one service in the foreground",
                       description="Run one berth service; configure it with BERTH_* variables "
                       "(see docs/configuration.md). `berth run worker --help` for workers.")
    p.add_argument("service", choices=["scheduler", "submitter", "dashboard", "worker"])
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe can still be caught
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        # The reader went away (`berth status | head -1`): end quietly, as a SIGPIPE
        # would, and keep Python from complaining as it flushes stdout on exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        code = 128 + signal.SIGPIPE
    return code


if __name__ == "__main__":
    sys.exit(main())
