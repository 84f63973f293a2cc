"""The `berth` command: its commands that act (submit, cancel, up, doctor, ...), and its
entry point, which registers every command module on one Typer app (berth/cli_app.py)."""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import signal
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import typer.main
from typer.core import TyperGroup

from berth import (
    admin_cli,
    backup,
    cli_read,
    creds_cli,
    health,
    limits_cli,
    node_cli,
    schedules_cli,
    token_cli,
)
from berth.cli_app import (
    Globals,
    JsonFlag,
    fail,
    globals_of,
    hoist_global_options,
    new_app,
    print_json,
)
from berth.client import ApiError, api_fetch, api_get, load_spec_file
from berth.creds_cli import cli_connection, cli_credentials, local_user
from berth.shared import config, subjects
from berth.shared.config import RedisSettings, parse_sentinels
from berth.shared.states import JOB_TERMINAL_NAMES
from berth.stack_info import read_stack_info

if TYPE_CHECKING:
    from berth.client import SubmitOutcome
    from berth.shared.credentials import Credentials

# Every `berth` command imports this module, `--help` and `--version` included: what only
# some commands need (the NATS client, Redis, the messages, workspaces) is imported in them.

app = new_app()


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"berth {version('berth')}")
        raise typer.Exit(0)


@app.callback()
def root(
    ctx: typer.Context,
    data_dir: Annotated[str | None, typer.Option(
        help="where `berth up` keeps NATS/Redis data and logs (default: $BERTH_DATA_DIR, "
        "the profile's, else .berth)")] = None,
    nats_url: Annotated[str | None, typer.Option(
        help="NATS URL, or several comma-separated (default: $BERTH_NATS_URL, the "
        "profile's, else `berth up`'s)")] = None,
    api_url: Annotated[str | None, typer.Option(
        help="dashboard API URL (default: $BERTH_API_URL, the profile's, else `berth up`'s)")]
    = None,
    profile: Annotated[str | None, typer.Option(
        help="the profile of the config file to use (default: $BERTH_PROFILE, the file's "
        "default_profile, else the one named default)")] = None,
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="print berth's version")] = False,
) -> None:
    if ctx.invoked_subcommand in VERBATIM:
        return  # a service (`berth run`) reads only its BERTH_* variables, no user's profile
    try:
        config.select_cli_profile(profile)
    except config.ConfigFileError as exc:
        fail(str(exc), 2)
    ctx.obj = Globals(data_dir or config.cli_data_dir(), nats_url, api_url)


# --- submit, cancel --------------------------------------------------------------------------


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
    import asyncio

    from berth.client import publish_submit, wait_for_outcome

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
            print(f"submit {seq} stored, no verdict yet (is the submitter running?); waiting "
                  f"up to {timeout:g}s ...", file=sys.stderr)
        try:
            return await wait_for_outcome(nc, seq, creds.user, max(timeout - 5, 1))
        except TimeoutError:
            raise SystemExit(
                f"berth: submit {seq} was stored but no verdict came within {timeout:g}s (is "
                f"the submitter running?); it will still be decided. To retry without "
                f"making a second job: --idempotency-key {key}") from None


async def _resolve(nats_url: str, data_dir: str, payload: bytes, base: Path) -> bytes:
    """`workspace` and `env_file` resolved: a bad one is said before anything connects."""
    from berth import workspace

    return await workspace.resolve(
        payload, base, lambda: cli_connection(nats_url, cli_credentials(data_dir)),
        lambda line: print(line, file=sys.stderr))


@app.command("submit")
def cmd_submit(
    ctx: typer.Context,
    file: Annotated[str, typer.Argument(
        help="the spec: a .json file is JSON, any other YAML 1.2; - reads standard input "
        "(JSON if it parses as JSON, else YAML)")],
    wait: Annotated[bool, typer.Option(
        help="watch the job until it ends (as `berth watch`)")] = False,
    timeout: Annotated[float, typer.Option(help="with --wait, seconds")] = 3600,
    idempotency_key: Annotated[str | None, typer.Option(
        metavar="KEY", help="a key that makes a retry of this same submit the same submit "
        "(not a second job) for 10 minutes; printed when a submit's fate is unknown")] = None,
    submit_timeout: Annotated[float, typer.Option(
        help="seconds to wait for the submitter's verdict")] = 120,
    workspace_dir: Annotated[str | None, typer.Option(
        "--workspace", metavar="DIR", help="pack DIR (honouring .gitignore and .berthignore) "
        "into a bundle each task runs in, as the spec's `workspace` does "
        "(docs/workspaces.md)")] = None,
) -> int:
    """Submit a job spec file (YAML or JSON); prints the job id."""
    import asyncio

    from berth import workspace

    where = globals_of(ctx)
    nats_url = where.nats_url()
    try:
        payload = load_spec_file(file)
        payload = workspace.with_workspace(payload, workspace_dir)
    except (OSError, ValueError) as exc:
        fail(str(exc), 2)
    if workspace.needs_resolving(payload):
        base = Path.cwd() if file == "-" else Path(file).resolve().parent
        try:
            payload = asyncio.run(_resolve(nats_url, where.data_dir, payload, base))
        except ValueError as exc:
            fail(str(exc), 2)
    outcome = asyncio.run(_submit(nats_url, cli_credentials(where.data_dir), payload,
                                  idempotency_key, submit_timeout))
    if not outcome.accepted:
        print(f"rejected: {outcome.reason}", file=sys.stderr)
        return 1
    print(outcome.job_id, flush=True)
    if outcome.note == "schedule":
        print(f"schedule {outcome.job_id}: {_schedule_words(payload)}", file=sys.stderr)
        return 0
    if outcome.note:  # stdout stays the job id alone, for scripts
        print(outcome.note, file=sys.stderr)
    waits = _waits_for(payload)
    if waits:  # stdout stays the job id alone, for scripts
        print(f"job {outcome.job_id} waits for {waits}", file=sys.stderr)
    if retry := _retry_words(payload):
        print(f"job {outcome.job_id} {retry}", file=sys.stderr)
    if wait:
        return cli_read.succeeded(
            cli_read.wait_for_end(where.api_url(), str(outcome.job_id), timeout))
    return 0


def _waits_for(payload: bytes) -> str:
    """The dependencies an accepted submit waits for, in words ("" for none)."""
    spec = json.loads(payload)  # the submitter accepted it: a valid spec
    parts = [f"{', '.join(spec['after'])} to succeed"] if spec.get("after") else []
    parts += [f"{', '.join(spec['after_any'])} to end"] if spec.get("after_any") else []
    return " and ".join(parts)



def _schedule_words(payload: bytes) -> str:
    from berth.shared import schedules
    from berth.shared.messages import decode, job_spec_decoder

    spec = decode(job_spec_decoder, payload)  # the submitter accepted it: a valid spec
    assert spec.schedule is not None
    cron, zone = spec.schedule.cron, spec.schedule.timezone
    first = schedules.next_fire(cron, zone, time.time())
    return (f"{cron!r} ({zone}), first run at "
            f"{datetime.fromtimestamp(first, UTC):%Y-%m-%d %H:%M:%S} UTC")


def _retry_words(payload: bytes) -> str:
    """What an accepted submit's retry policy will do, in words ("" without one)."""
    from berth.shared.messages import decode, job_spec_decoder

    spec = decode(job_spec_decoder, payload)  # the submitter accepted it: a valid spec
    return spec.retry.describe() if spec.retry is not None else ""


async def _cancel(nats_url: str, creds: Credentials, job_id: str, reason: str
                  ) -> SubmitOutcome:
    from berth.client import cancel_job

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
    return state if state in JOB_TERMINAL_NAMES else None

@app.command("cancel")
def cmd_cancel(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="job id, e.g. j42-1a2b")],
    reason: Annotated[str, typer.Option(help="recorded with the job's error")] = "",
    wait: Annotated[bool, typer.Option(help="wait until the job has ended")] = False,
    timeout: Annotated[float, typer.Option(help="with --wait, seconds")] = 120,
) -> int:
    """Cancel a job: kill its unfinished tasks, cancel its children.

    Its unfinished tasks are killed (SIGTERM, then SIGKILL after BERTH_KILL_GRACE seconds)
    and its child jobs are cancelled. Cancelling a job that already ended changes nothing:
    berth says so and exits with status 1."""
    import asyncio

    where = globals_of(ctx)
    api_url = where.api_url()
    # Cancelling a job that already ended changes nothing: say so, and fail, rather than
    # report a cancel that did not happen.
    if (state := _ended(api_url, job)) is not None:
        fail(f"job {job} already ended ({state}); nothing to cancel")
    creds = cli_credentials(where.data_dir)
    outcome = asyncio.run(_cancel(where.nats_url(), creds, job, reason))
    if not outcome.accepted:
        print(f"rejected: {outcome.reason}", file=sys.stderr)
        return 1
    print(f"cancelling {job} (request {outcome.submit_seq})", file=sys.stderr)
    if wait and cli_read.wait_for_end(api_url, job, timeout) is None:
        return 1
    return 0


# --- operators: devices, doctor, health ------------------------------------------------------


async def _device_health(nats_url: str, creds: Credentials, worker_id: str, index: int,
                         healthy: bool, reason: str) -> None:
    from berth.shared import nats_io
    from berth.shared.messages import DeviceHealthChanged

    async with cli_connection(nats_url, creds) as nc:
        await nats_io.publish_event(
            nc.jetstream(), subjects.worker_events(worker_id),
            DeviceHealthChanged(worker_id=worker_id, index=index, healthy=healthy,
                                reason=reason, by=local_user() or "operator", ts=time.time()),
            msg_id=f"device:{worker_id}:{index}:{uuid.uuid4().hex}")


class DeviceAction(enum.StrEnum):
    ENABLE = "enable"
    DISABLE = "disable"


@app.command("device")
def cmd_device(
    ctx: typer.Context,
    action: Annotated[DeviceAction, typer.Argument()],
    worker: Annotated[str, typer.Argument(help="worker id")],
    index: Annotated[int, typer.Argument(help="the device's index (`berth workers` lists "
                                         "them)")],
    reason: Annotated[str, typer.Option(help="recorded with a disable")] = "",
) -> int:
    """Take a worker's device (GPU) out of service, or return it.

    disable: no new attempt is placed on the device, and the one running on it is killed
    and retried elsewhere (a worker failure, not the user's). enable: return a device to
    service, e.g. one its worker reported unhealthy (NVML errors, uncorrectable ECC errors,
    gone from the bus) once it is fixed. Speaks as the admin identity."""
    import asyncio

    where = globals_of(ctx)
    try:
        found = api_get(where.api_url(), f"/api/workers/{worker}")
    except ApiError as exc:
        fail(f"worker {worker}: {exc}")
    indices = [d["index"] for d in found.get("devices", [])]
    if index not in indices:
        fail(f"index: worker {worker} has no device {index} (it has "
             f"{', '.join(map(str, indices)) or 'none'})")
    healthy = action is DeviceAction.ENABLE
    why = reason or ("" if healthy else "taken out of service by an operator")
    asyncio.run(_device_health(where.nats_url(), cli_credentials(where.data_dir, admin=True),
                               worker, index, healthy, why))
    print(f"device {index} of {worker} "
          f"{'returned to service' if healthy else 'takes no new attempts'}")
    return 0


async def _doctor(nats_url: str, creds: Credentials, redis: RedisSettings) -> Any:
    from berth.shared import redis_io
    from berth.shared.checker import check_cluster
    from berth.shared.reservations import ReservationStore

    async with cli_connection(nats_url, creds) as nc:
        client = redis_io.open_client(redis, redis_io.BULK_READ_TIMEOUT)
        try:
            return await check_cluster(nc.jetstream(), ReservationStore(client))
        finally:
            await client.aclose()

def doctor_redis(data_dir: str, redis_url: str | None) -> RedisSettings:
    """Where and as whom `berth doctor` reads Redis: --redis-url, then BERTH_REDIS_URL (with
    BERTH_REDIS_SENTINELS), else beside a running `berth up`: its Redis (or Sentinels) as
    the read-only `doctor` user, whose password is in <data dir>/auth/redis.json."""
    from berth.shared import redis_auth

    explicit = redis_url or RedisSettings.url_from_env()
    if explicit:
        return RedisSettings.from_env(explicit)
    info = read_stack_info(data_dir)
    url = info.get("redis_url", "redis://127.0.0.1:6379/0")
    if redis_auth.RedisUsers.path_of(data_dir).exists():
        users = redis_auth.RedisUsers.load(data_dir)
        url = redis_auth.with_user(url, redis_auth.DOCTOR, users.passwords[redis_auth.DOCTOR])
    settings = RedisSettings.from_env(url)
    if not settings.sentinels and info.get("redis_sentinels"):
        settings = dataclasses.replace(
            settings, sentinels=parse_sentinels(info["redis_sentinels"], "stack.json"),
            master=info.get("redis_master", settings.master))
    return settings

RedisUrlOption = Annotated[str | None, typer.Option(
    help="Redis URL with the doctor user's credentials (default: $BERTH_REDIS_URL, else "
    "`berth up`'s, as its doctor user)")]


@app.command("doctor")
def cmd_doctor(ctx: typer.Context, redis_url: RedisUrlOption = None,
               as_json: JsonFlag = False) -> int:
    """Check the placement invariants from Redis and the event log.

    Reads Redis and the event log and reports every violation of the placement invariants:
    over-committed hosts, a group held by two gangs, a host shared by two gangs, a port
    given twice, a device (GPU) given to two live attempts, reservations with no live
    attempt, live attempts with no reservation, an attempt admitted over its user's quota
    or a token's limit, quota or token counters that disagree with the reservations.
    Prints double_booked_hosts=0, double_booked_ports=0 and double_booked_devices=0 when
    all is well (ports are counted per host address, devices per worker); exit status 1
    when anything is wrong. releases_owed counts reservations of ended attempts that a
    leader behind the log has not released yet, assignments_unlogged reservations whose
    assignment is not logged yet: lag, not violations."""
    import asyncio

    from redis.exceptions import RedisError

    from berth.shared import redis_auth, redis_io

    where = globals_of(ctx)
    try:
        redis = doctor_redis(where.data_dir, redis_url)
    except redis_auth.RedisAuthError as exc:
        print(f"berth doctor: {exc}", file=sys.stderr)
        return 2
    shown = redis_auth.redact(redis.url)
    if redis.sentinels:
        shown += f" (primary {redis.master!r} from Sentinel " + ",".join(
            f"{h}:{p}" for h, p in redis.sentinels) + ")"
    print(f"checking placement invariants (events and {shown}) ...", file=sys.stderr)
    try:
        report = asyncio.run(_doctor(where.nats_url(),
                                     cli_credentials(where.data_dir, admin=True), redis))
    except (redis_io.RedisConfigError, RedisError) as exc:
        print(f"berth doctor: Redis at {shown}: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print_json({"ok": report.ok, "violations": report.violations(),
                    "events_seq": report.events_seq,
                    "refused_double_bookings": report.refused_double_bookings,
                    "refused_events": report.refused_events,
                    "last_refused_seq": report.last_refused_seq,
                    "double_booked_hosts": report.double_booked_hosts,
                    "double_booked_ports": report.double_booked_ports,
                    "double_booked_devices": report.double_booked_devices,
                    "over_quota": len(report.over_quota),
                    "over_token_limit": len(report.over_token_limit),
                    "limit_use_miscounted": len(report.limit_use_miscounted),
                    "attempt_keys_reused": len(report.attempt_keys_reused),
                    "releases_owed": len(report.releases_owed),
                    "assignments_unlogged": len(report.assignments_unlogged),
                    "released_through": report.released_through})
        return 0 if report.ok else 1
    for line in report.violations():
        print(f"VIOLATION {line}")
    print(f"events_seq={report.events_seq}")
    print(f"refused_double_bookings={report.refused_double_bookings}")
    print(f"refused_events={report.refused_events} (last at {report.last_refused_seq})")
    print(f"double_booked_hosts={report.double_booked_hosts}")
    print(f"double_booked_ports={report.double_booked_ports}")
    print(f"double_booked_devices={report.double_booked_devices}")
    print(f"taken_from_preemptor={len(report.taken_from_preemptor)}")
    print(f"over_quota={len(report.over_quota)}")
    print(f"over_token_limit={len(report.over_token_limit)}")
    print(f"limit_use_miscounted={len(report.limit_use_miscounted)}")
    print(f"attempt_keys_reused={len(report.attempt_keys_reused)}")
    print(f"releases_owed={len(report.releases_owed)} (the leader has written its releases "
          f"through events seq {report.released_through})")
    print(f"assignments_unlogged={len(report.assignments_unlogged)}")
    print(f"violations={len(report.violations())}")
    return 0 if report.ok else 1


async def _leader_lease(redis: RedisSettings) -> tuple[str | None, int]:
    """The leader key and its TTL in ms (negative when absent), as `berth doctor` reads."""
    from berth.shared import redis_io, redis_keys

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

@app.command("health")
def cmd_health(ctx: typer.Context, redis_url: RedisUrlOption = None,
               as_json: JsonFlag = False) -> int:
    """One line per service: leading, caught up, heartbeating.

    Whether the scheduler holds the leader lease (and its epoch), the dashboard has caught
    up with the event log, and each worker heartbeats; beside a running `berth up`, also how
    often it restarted its children. Exit status 1 when anything is unhealthy."""
    import asyncio

    from redis.exceptions import RedisError

    from berth.shared import redis_auth, redis_io

    where = globals_of(ctx)
    api_url = where.api_url()
    verdicts: list[health.Verdict] = []
    try:
        redis = doctor_redis(where.data_dir, redis_url)
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
    if (stack := health.children(read_stack_info(where.data_dir))) is not None:
        verdicts.append(stack)
    if as_json:
        print_json([{"service": v.service, "ok": v.ok, "detail": v.detail} for v in verdicts])
    for verdict in [] if as_json else verdicts:
        print(verdict.line())
    return 0 if all(v.ok for v in verdicts) else 1


# --- the local stack, services ---------------------------------------------------------------


class Service(enum.StrEnum):
    SCHEDULER = "scheduler"
    SUBMITTER = "submitter"
    DASHBOARD = "dashboard"
    WORKER = "worker"


@app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                      "help_option_names": []})
def cmd_run(ctx: typer.Context, service: Annotated[Service, typer.Argument()]) -> int:
    """Run one service in the foreground.

    Run one berth service; configure it with BERTH_* variables (see
    docs/configuration.md). `berth run worker --help` for workers."""
    rest = list(ctx.args)
    sys.argv = [f"berth run {service.value}", *rest]
    if service is Service.WORKER:
        from berth.services.worker_agent.service import main as worker_main

        worker_main(rest)
        return 0
    if rest:
        fail(f"run {service.value} takes no arguments (configure with BERTH_* variables)", 2)
    from berth.services.dashboard_api.service import main as dashboard_main
    from berth.services.scheduler.service import main as scheduler_main
    from berth.services.submitter.service import main as submitter_main

    mains: dict[Service, Callable[[], None]] = {
        Service.SCHEDULER: scheduler_main, Service.SUBMITTER: submitter_main,
        Service.DASHBOARD: dashboard_main}
    mains[service]()
    return 0


Workers = Annotated[int, typer.Option(help="local workers")]
WorkerCpu = Annotated[float, typer.Option(help="cpu cores each local worker offers")]
WorkerMemory = Annotated[int, typer.Option(help="memory each local worker offers, MiB")]
Port = Annotated[int | None, typer.Option(help="dashboard port (default: a free port)")]
NatsPort = Annotated[int | None, typer.Option(
    help="default: a free port (with --nats-nodes: the first node's)")]
NatsNodes = Annotated[int, typer.Option(
    metavar="N", help="run NATS as a JetStream cluster of N nodes on loopback, streams with "
    "min(N, 3) replicas (default: 1, one server)")]
RedisPort = Annotated[int | None, typer.Option(help="default: a free port")]
RedisServer = Annotated[bool, typer.Option(
    help="use redis-server from PATH instead of the bundled valkey-server")]
Metrics = Annotated[bool, typer.Option(
    "--metrics", help="every service serves Prometheus metrics, each on a free port of its "
    "own (BERTH_METRICS_PORT; docs/metrics.md); the URLs are printed")]
MetricsPort = Annotated[int | None, typer.Option(
    min=1, max=65_000, metavar="PORT", help="with --metrics: ports from PORT on, in the "
    "order submitter, scheduler, dashboard, local-0, local-1, ... (default: free ports)")]


def _start(data_dir_given: str, workers: int, worker_cpu: float, worker_memory_mb: int,
           port: int | None, nats_port: int | None, redis_port: int | None,
           redis_server: bool, nats_nodes: int, metrics: bool = False,
           metrics_port: int | None = None) -> Any:
    from berth.shared.dir_lock import DirLocked
    from berth.shared.servers import ServerError
    from berth.stack import start_stack

    data_dir = Path(data_dir_given).resolve()
    print(f"starting berth in {data_dir} ...", file=sys.stderr)
    try:
        stack = start_stack(
            data_dir, workers=workers, worker_cpu=worker_cpu,
            worker_memory_mb=worker_memory_mb, api_port=port,
            nats_port=nats_port, redis_port=redis_port,
            prefer_redis_on_path=redis_server, nats_nodes=nats_nodes,
            # A given first port makes the range (start_services); free ones otherwise.
            metrics=metrics and metrics_port is None,
            extra_env={"BERTH_METRICS_PORT": str(metrics_port)} if metrics_port else None,
        )
    except (DirLocked, ServerError) as exc:  # what it started is stopped again
        fail(str(exc))
    nodes = len(stack.nats.nodes)
    if nodes > 1:
        print(f"  NATS       {nodes} nodes, streams with {stack.nats.stream_replicas} "
              "replicas (docs/nats-cluster.md)", file=sys.stderr)
    print(f"  NATS       {stack.nats.url}\n"
          f"  Redis      {stack.redis.url} (users: {data_dir / 'auth' / 'redis.json'})\n"
          f"  dashboard  {stack.api_url}/\n  workers    {workers}\n"
          f"  logs       {data_dir / 'logs'}\n"
          f"  identities {stack.auth.path} (`berth creds --help`)\n"
          f"  API token  {data_dir / 'api-token'} (for submit and cancel over HTTP)",
          file=sys.stderr)
    for label, url in stack.metrics_urls.items():
        print(f"  metrics    {label:<10} {url}", file=sys.stderr)
    return stack


@app.command("up")
def cmd_up(ctx: typer.Context, workers: Workers = 2, worker_cpu: WorkerCpu = 2.0,
           worker_memory_mb: WorkerMemory = 2048, port: Port = None,
           nats_port: NatsPort = None, nats_nodes: NatsNodes = 1, redis_port: RedisPort = None,
           redis_server: RedisServer = False, metrics: Metrics = False,
           metrics_port: MetricsPort = None) -> int:
    """Start NATS, Redis, all services and local workers."""
    from berth.shared.servers import ServerError

    if metrics_port is not None and not metrics:
        fail("--metrics-port: only with --metrics")
    stack = _start(globals_of(ctx).data_dir, workers, worker_cpu, worker_memory_mb, port,
                   nats_port, redis_port, redis_server, nats_nodes, metrics, metrics_port)
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


@app.command("demo")
def cmd_demo(ctx: typer.Context, workers: Workers = 2, worker_cpu: WorkerCpu = 2.0,
             worker_memory_mb: WorkerMemory = 2048, port: Port = None,
             nats_port: NatsPort = None, nats_nodes: NatsNodes = 1,
             redis_port: RedisPort = None, redis_server: RedisServer = False,
             timeout: Annotated[float, typer.Option(help="seconds to wait")] = 120) -> int:
    """Start berth, run a demo job to completion, stop."""
    import asyncio

    stack = _start(globals_of(ctx).data_dir, workers, worker_cpu, worker_memory_mb, port,
                   nats_port, redis_port, redis_server, nats_nodes)
    try:
        from importlib import resources

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
        code = cli_read.succeeded(
            cli_read.wait_for_end(stack.api_url, str(outcome.job_id), timeout))
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


@app.command("schema")
def cmd_schema() -> int:
    """Print the JSON Schema of the submit message."""
    from berth.shared.messages import job_spec_schema

    print(json.dumps(job_spec_schema(), indent=2))
    return 0


# Each module that adds commands registers them here.
for module in (cli_read, node_cli, creds_cli, backup, token_cli, limits_cli, schedules_cli,
               admin_cli):
    module.register(app)

# Subcommands that pass their arguments on as they are (a global flag among them is theirs).
VERBATIM = ("run",)


@functools.cache
def _command() -> TyperGroup:
    """The app as a command, built once (tests call main many times in one process)."""
    command = typer.main.get_command(app)
    assert isinstance(command, TyperGroup)
    return command


def main(argv: list[str] | None = None) -> int:
    args = hoist_global_options(sys.argv[1:] if argv is None else argv, VERBATIM)
    try:
        code = _command().main(args=args, prog_name="berth", standalone_mode=False)
    except typer.TyperException as exc:  # a usage error: one line, naming the command
        where = str(getattr(getattr(exc, "ctx", None), "command_path", None) or "berth")
        print(f"{where}: {exc.format_message()} (see `{where} --help`)", file=sys.stderr)
        return exc.exit_code
    except (KeyboardInterrupt, typer.Abort):
        return 130
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
