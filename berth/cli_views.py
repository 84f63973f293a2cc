"""How the `berth` command shows what the dashboard API returns: pure functions from the
API's JSON (plain dicts) to lines of text or Rich renderables; no I/O."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from berth.shared.states import TaskState

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.table import Table

# Rich is imported by the views that build renderables: `berth status JOB` prints plain
# lines and starts faster without it.


def counts(task_counts: dict[str, int]) -> str:
    return " ".join(f"{n} {s}" for s, n in sorted(task_counts.items()))


def clock(ts: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "-"


def format_attempt(a: dict[str, Any]) -> str:
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
    span = f"assigned {clock(a['assigned_at'])}"
    if a["started_at"]:
        span += f", started {clock(a['started_at'])}"
    if a["finished_at"]:
        span += f", ended {clock(a['finished_at'])}"
    # An error's further lines (a failed build's output tail) go below, indented.
    return "\n".join([f"{line}  [{span}]", *(f"      | {x}" for x in rest.splitlines())])


def format_job(job: dict[str, Any]) -> str:
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
        lines += [format_attempt(a) for a in task["attempts"]]
        lines += [f"    refused report: {why}" for why in task["refused_reports"]]
    return "\n".join(lines)


def format_worker(w: dict[str, Any]) -> list[str]:
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
            away += f" (deadline {clock(w['drain_deadline'])})"
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




def _age(ts: float | None, now: float) -> str:
    return "-" if ts is None else f"{max(now - ts, 0):.0f}s ago"


def jobs_table(jobs: list[dict[str, Any]]) -> Table:
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("JOB", "NAME", "USER", "STATE", "SUBMITTED", "TASKS"):
        table.add_column(column, no_wrap=column != "TASKS")
    for job in jobs:
        table.add_row(job["job_id"], job["name"], job["user"] or "-", job["state"],
                      clock(job["submitted_at"]), counts(job["task_counts"]))
    return table


def worker_state(w: dict[str, Any]) -> str:
    """Healthy or not, and out of service (cordoned, draining, quarantined) if it is."""
    away = str(w.get("out_of_service") or "").partition(":")[0]
    return ("healthy" if w["healthy"] else "unhealthy") + (f", {away}" if away else "")


def workers_table(workers: list[dict[str, Any]], now: float) -> Table:
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("WORKER", "STATE", "CPU USED/ALL", "MEMORY MiB USED/ALL", "DEVICES FREE",
                   "RUNNING", "ATTRIBUTES", "HEARTBEAT"):
        table.add_column(column, no_wrap=column != "ATTRIBUTES")
    for w in workers:
        res = w["resources"]
        device = res["device"]
        devices = "-" if device["type"] == "cpu" else \
            f"{w['devices_free']}/{device['count']} {device['type']}:{device['variant']}"
        table.add_row(
            w["worker_id"], worker_state(w),
            f"{res['cpu'] - w['cpu_free']:g}/{res['cpu']:g}",
            f"{res['memory_mb'] - w['memory_free_mb']}/{res['memory_mb']}", devices,
            str(len(w["running_attempts"])),
            " ".join(f"{k}={v}" for k, v in sorted(w["attributes"].items())) or "-",
            _age(w["last_heartbeat"], now))
    return table


def why_lines(job: dict[str, Any], place: dict[str, Any] | None) -> list[str]:
    """Why each pending task of the job waits, and where the job stands in its band."""
    pending = [t for t in job["tasks"] if t["state"] == TaskState.PENDING.display]
    if not pending:
        return [f"job {job['job_id']} ({job['name']}) is {job['state']}: no task is pending"]
    lines = [f"job {job['job_id']} ({job['name']}): {len(pending)} of "
             f"{len(job['tasks'])} tasks pending"]
    if job.get("waiting_for"):
        lines.append(f"  waiting for: {job['waiting_for']}")
    if place is not None:
        lines.append(f"  queue: position {place['position']} of {place['of']} in band "
                     f"{place['band']} (placed in band order, then users by fair share, each "
                     "user's jobs first come first served)")
    lines += [f"  task {t['index']}: {t['pending_reason'] or 'waiting to be placed'}"
              for t in pending]
    return lines


def watch_view(job: dict[str, Any]) -> RenderableType:
    """A job's state with a bar per task state: how many of its tasks are in it."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    total = max(len(job["tasks"]), 1)
    table = Table(box=None, pad_edge=False, show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(no_wrap=True)
    table.add_column(no_wrap=True, justify="right")
    for state, n in sorted(job["task_counts"].items()):
        table.add_row(state, ProgressBar(total=total, completed=n, width=40), f"{n}/{total}")
    head = Text(f"job {job['job_id']} ({job['name']}): {job['state']}", style="bold")
    return Group(head, table)
