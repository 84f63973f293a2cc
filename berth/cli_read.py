"""The `berth` commands that read (over the dashboard API): jobs, status, watch, logs,
workers, why. Each prints JSON with --json; an API failure is one line."""

from __future__ import annotations

import sys
import time
import urllib.parse
from typing import Annotated, Any

import typer

from berth import cli_views
from berth.cli_app import JsonFlag, console, fail, globals_of, print_json
from berth.client import ApiError, api_get, api_stream
from berth.shared.states import JOB_TERMINAL_NAMES, JobState, TaskState
from berth.shared.subjects import LOG_STREAMS

POLL = 0.2


def _get(api_url: str, path: str) -> Any:
    try:
        return api_get(api_url, path)
    except ApiError as exc:
        fail(str(exc))


def _query(**params: object) -> str:
    given = {k: str(v).lower() if isinstance(v, bool) else str(v)
             for k, v in params.items() if v is not None}
    return f"?{urllib.parse.urlencode(given)}" if given else ""


def _job_path(job_id: str) -> str:
    return f"/api/jobs/{urllib.parse.quote(job_id, safe='')}"


def jobs(
    ctx: typer.Context,
    state: Annotated[str | None, typer.Option(help="only jobs in this state, e.g. running")]
    = None,
    user: Annotated[str | None, typer.Option(help="only this user's jobs")] = None,
    name: Annotated[str | None, typer.Option(help="only jobs whose name starts with this")]
    = None,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="jobs per page")] = 50,
    cursor: Annotated[str | None, typer.Option(
        help="the page after this one (the cursor the previous page printed)")] = None,
    as_json: JsonFlag = False,
) -> int:
    """List jobs, newest first, a page at a time."""
    api_url = globals_of(ctx).api_url()
    page = _get(api_url, "/api/jobs" + _query(state=state, user=user, name_prefix=name,
                                               limit=limit, cursor=cursor))
    if as_json:
        print_json(page)
        return 0
    console().print(cli_views.jobs_table(page["jobs"]))
    if page["next_cursor"]:
        print(f"(more: berth jobs --cursor {page['next_cursor']})", file=sys.stderr)
    return 0


def status(
    ctx: typer.Context,
    job: Annotated[str | None, typer.Argument(help="a job id; none: list the newest jobs")]
    = None,
    as_json: JsonFlag = False,
) -> int:
    """Show a job's tasks and attempts (or list the newest jobs).

    One job: its tasks, their attempts (worker, devices, exit, peaks once reported) and why
    a task waits; without JOB, the newest jobs."""
    api_url = globals_of(ctx).api_url()
    if job is None:
        page = _get(api_url, "/api/jobs?limit=100")
        if as_json:
            print_json(page)
            return 0
        console().print(cli_views.jobs_table(page["jobs"]))
        if page["next_cursor"]:
            print("(the 100 newest jobs; `berth jobs --cursor ...` for older ones)",
                  file=sys.stderr)
        return 0
    detail = _get(api_url, _job_path(job))
    if as_json:
        print_json(detail)
    else:
        print(cli_views.format_job(detail))
    return 0


def wait_for_end(api_url: str, job_id: str, timeout: float) -> dict[str, Any] | None:
    """Follows the job until it ends: a live view on a terminal, else a line on stderr each
    time its task counts change; then prints the ended job. Returns it, or None (after
    saying why) on an error or timeout."""
    from rich.live import Live

    deadline = time.monotonic() + timeout
    err = console(stderr=True)
    last = ""
    with Live(console=err, auto_refresh=False, transient=True) if err.is_terminal \
            else _NoLive() as live:
        while True:
            try:
                job: dict[str, Any] = api_get(api_url, _job_path(job_id))
            except ApiError as exc:
                if "404" not in str(exc) or time.monotonic() > deadline:
                    print(f"berth: {exc}", file=sys.stderr)
                    return None
                time.sleep(POLL)
                continue
            if isinstance(live, Live):
                live.update(cli_views.watch_view(job), refresh=True)
            elif (summary := cli_views.counts(job["task_counts"])) != last:
                print(f"  {job['state']}: {summary}", file=sys.stderr)
                last = summary
            if job["state"] in JOB_TERMINAL_NAMES:
                break
            if time.monotonic() > deadline:
                print(f"berth: job {job_id} still {job['state']} after {timeout:.0f}s",
                      file=sys.stderr)
                return None
            time.sleep(POLL)
    if err.is_terminal:
        err.print(cli_views.watch_view(job))
    print(cli_views.format_job(job))
    return job


class _NoLive:
    """Where stderr is no terminal: nothing to redraw."""

    def __enter__(self) -> _NoLive:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def succeeded(job: dict[str, Any] | None) -> int:
    """Exit status 0 when the job succeeded."""
    return 0 if job is not None and job["state"] == JobState.SUCCEEDED.display else 1


def watch(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="a job id")],
    timeout: Annotated[float, typer.Option(help="seconds to watch at most")] = 3600,
    as_json: JsonFlag = False,
) -> int:
    """Watch a job live until it ends.

    Its tasks by state, as bars; then the job as `status` shows it. Exit status 0 when it
    succeeded."""
    api_url = globals_of(ctx).api_url()
    if not as_json:
        return succeeded(wait_for_end(api_url, job, timeout))
    deadline = time.monotonic() + timeout
    while (detail := _get(api_url, _job_path(job)))["state"] not in JOB_TERMINAL_NAMES:
        if time.monotonic() > deadline:
            fail(f"job {job} still {detail['state']} after {timeout:.0f}s")
        time.sleep(POLL)
    print_json(detail)
    return succeeded(detail)


def logs(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="a job id")],
    task: Annotated[int, typer.Argument(min=0, help="the task's index")] = 0,
    attempt: Annotated[int | None, typer.Option(
        min=0, help="which attempt (default: the latest)")] = None,
    follow: Annotated[bool, typer.Option(
        "--follow", "-f", help="keep printing until the attempt ends")] = False,
    stderr: Annotated[bool, typer.Option(
        "--stderr", help="only its standard error (default: stdout and stderr as written)")]
    = False,
) -> int:
    """Print a task attempt's output."""
    api_url = globals_of(ctx).api_url()
    task_path = f"{_job_path(job)}/tasks/{task}"
    if follow and attempt is None:
        # A task not yet placed has no attempt to follow: wait for its first.
        while (t := _get(api_url, task_path))["current_attempt"] is None:
            if t["job_state"] in JOB_TERMINAL_NAMES:
                fail(f"task {job}/{task} ended without an attempt ({t['state']})")
            time.sleep(POLL)
        attempt = t["current_attempt"]
    stream = LOG_STREAMS[1] if stderr else None
    path = f"{task_path}/logs" + _query(attempt=attempt, follow=follow or None,
                                        stream=stream)
    out = sys.stdout.buffer
    try:
        # Followed: the server ends the body once the attempt has ended.
        for chunk in api_stream(api_url, path, timeout=None if follow else 30):
            out.write(chunk)
            if follow:
                out.flush()
    except ApiError as exc:
        fail(str(exc))
    return 0


def workers(ctx: typer.Context, as_json: JsonFlag = False) -> int:
    """List the workers, their resources and devices (GPUs).

    Each worker's state, resources used and free, attributes and last heartbeat; then each
    device: model, holder, health."""
    listed = _get(globals_of(ctx).api_url(), "/api/workers")
    if as_json:
        print_json(listed)
        return 0
    console().print(cli_views.workers_table(listed, time.time()))
    for w in listed:  # why it is out of service, and its devices
        if details := cli_views.format_worker(w)[1:]:
            print("\n".join([f"{w['worker_id']}:", *details]))
    return 0


def why(ctx: typer.Context, job: Annotated[str, typer.Argument(help="a job id")],
        as_json: JsonFlag = False) -> int:
    """Say why a job's tasks are pending.

    Each pending task's reason, and where the job stands in its priority band's queue."""
    api_url = globals_of(ctx).api_url()
    detail = _get(api_url, _job_path(job))
    place = _get(api_url, f"{_job_path(job)}/queue")
    if as_json:
        print_json({"job_id": detail["job_id"], "state": detail["state"],
                    "waiting_for": detail["waiting_for"], "queue": place,
                    "pending": [{"index": t["index"], "reason": t["pending_reason"]}
                                for t in detail["tasks"]
                                if t["state"] == TaskState.PENDING.display]})
        return 0
    print("\n".join(cli_views.why_lines(detail, place)))
    return 0


def register(app: typer.Typer) -> None:
    for command in (jobs, status, watch, logs, workers, why):
        app.command()(command)
