"""`berth schedules [--json]` and `berth schedules cancel ID` (docs/lifecycle.md,
"Schedules"): the list is read over the dashboard API; a cancel is a cancel message naming
the schedule, decided by the submitter like a job's."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Annotated, Any

import typer

from berth.cli_app import JsonFlag, fail, globals_of, print_json
from berth.client import ApiError, api_get, cancel_job
from berth.creds_cli import cli_connection, cli_credentials

schedules = typer.Typer(
    name="schedules", invoke_without_command=True,
    help="List schedules with their next run; `berth schedules cancel ID` cancels one.")


def _when(epoch: float | None) -> str:
    return "-" if epoch is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(epoch))


def table(rows: list[dict[str, Any]]) -> str:
    """The schedules as plain text, one a line (times in UTC)."""
    lines = [f"{'ID':<14} {'NAME':<20} {'CRON':<20} {'ZONE':<16} {'NEXT RUN (UTC)':<20} "
             f"{'FIRED':>5} LAST JOB"]
    for r in rows:
        nxt = "cancelled" if r["cancelled_at"] else _when(r["next_run"])
        lines.append(f"{r['schedule_id']:<14} {r['name']:<20} {r['cron']:<20} "
                     f"{r['timezone']:<16} {nxt:<20} {r['fired']:>5} {r['last_job'] or '-'}")
    return "\n".join(lines)


@schedules.callback()
def cmd_schedules(ctx: typer.Context, as_json: JsonFlag = False) -> int:
    """List schedules: their cron, next run, how often they fired and their last job."""
    if ctx.invoked_subcommand is not None:
        return 0
    try:
        rows = api_get(globals_of(ctx).api_url(), "/api/schedules")
    except ApiError as exc:
        fail(str(exc))
    if as_json:
        print_json(rows)
    else:
        print(table(rows))
    return 0


@schedules.command("cancel")
def cmd_schedules_cancel(
    ctx: typer.Context,
    schedule_id: Annotated[str, typer.Argument(metavar="ID", help="e.g. s42-1a2b")],
    reason: Annotated[str, typer.Option(help="recorded with the cancel")] = "",
) -> int:
    """Cancel a schedule: it fires no more; the jobs it made run on."""
    if not schedule_id.startswith("s"):
        fail(f"ID: {schedule_id!r} is not a schedule id (those start with s, e.g. s42-1a2b)")
    where = globals_of(ctx)
    creds = cli_credentials(where.data_dir)

    async def cancel() -> Any:
        async with cli_connection(where.nats_url(), creds) as nc:
            return await cancel_job(nc, schedule_id, reason, creds.user)

    outcome = asyncio.run(cancel())
    if not outcome.accepted:
        print(f"rejected: {outcome.reason}", file=sys.stderr)
        return 1
    print(f"schedule {schedule_id} cancelled", file=sys.stderr)
    return 0


def register(app: typer.Typer) -> None:
    app.add_typer(schedules)
