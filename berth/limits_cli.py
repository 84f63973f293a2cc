"""`berth quota set/list` and `berth tokens set/list`: per-user quotas and named tokens
(docs/placement.md "Quotas", docs/lifecycle.md "Tokens"). A change is one admin event on
an admin-only subject (shared/subjects.py), so the event log records who set what; every
scheduler folds it, and the leader writes it to Redis for the placement commit to enforce.
Lists read the dashboard API, which folds the same log."""

from __future__ import annotations

import math
import re
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from berth.cli_app import JsonFlag, console, fail, globals_of, print_json
from berth.client import ApiError, api_get
from berth.creds_cli import cli_connection, cli_credentials, local_user
from berth.shared import subjects

if TYPE_CHECKING:
    from berth.shared.credentials import Credentials
    from berth.shared.messages import Event, Quota

# asyncio and the messages are imported by the commands that publish, not by every `berth`
# command (each imports this module to register these).

quota = typer.Typer(name="quota", no_args_is_help=True,
                    help="Per-user quotas: most cpu, memory and devices one user's running "
                    "tasks may hold at once (docs/placement.md).")
tokens = typer.Typer(name="tokens", no_args_is_help=True,
                     help="Named cluster-wide counters a job's tasks hold while they run "
                     "(`tokens: {NAME: N}` in a spec; docs/lifecycle.md).")

DEFAULT_USER = "*"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
USER = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def quota_of(cpu: float | None, memory_mb: int | None, devices: int | None) -> Quota:
    """The quota the options ask for; a bad one ends the command with one line naming it."""
    for field, value in (("--cpu", cpu), ("--memory-mb", memory_mb), ("--devices", devices)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            fail(f"{field}: {value:g} is not a limit (a number, 0 or more)")
    from berth.shared.messages import Quota

    return Quota(cpu=None if cpu is None else round(cpu * 1000), mem=memory_mb, dev=devices)


def check_user(user: str) -> str:
    """The event's user ("" for the default, given as '*')."""
    if user == DEFAULT_USER:
        return ""
    if not USER.match(user):
        fail(f"USER: {user!r} is not a user name (1-128 letters, digits, '-' and '_'), nor "
             f"'{DEFAULT_USER}' for the default")
    return user


def check_token_name(name: str) -> str:
    if not NAME.match(name):
        fail(f"NAME: {name!r} is not a token name (1-63 letters, digits, '-' and '_', "
             "starting with a letter or digit)")
    return name


async def _publish(nats_url: str, creds: Credentials, subject: str, event: Event,
                   msg_id: str) -> None:
    from berth.shared import nats_io

    async with cli_connection(nats_url, creds) as nc:
        await nats_io.publish_event(nc.jetstream(), subject, event, msg_id=msg_id)


def _admin_publish(ctx: typer.Context, subject: str, event: Event, msg_id: str) -> None:
    import asyncio

    where = globals_of(ctx)
    asyncio.run(_publish(where.nats_url(), cli_credentials(where.data_dir, admin=True),
                         subject, event, msg_id))


def _limits(ctx: typer.Context) -> Any:
    try:
        return api_get(globals_of(ctx).api_url(), "/api/limits")
    except ApiError as exc:
        fail(f"limits: {exc}")


def _cores(milli: int | None) -> str:
    return "-" if milli is None else f"{milli / 1000:g}"


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


@quota.command("set")
def cmd_quota_set(
    ctx: typer.Context,
    user: Annotated[str, typer.Argument(help="the user, or '*' for every user's default")],
    cpu: Annotated[float | None, typer.Option(help="cores")] = None,
    memory_mb: Annotated[int | None, typer.Option("--memory-mb", help="MiB")] = None,
    devices: Annotated[int | None, typer.Option(help="accelerator devices")] = None,
) -> None:
    """Set USER's quota (replacing what was set for them); a limit left out falls back to
    the default ('*'), and the default's to no limit. Running work is never stopped: a
    user over a lowered quota runs nothing new until back under it."""
    q = quota_of(cpu, memory_mb, devices)
    who = check_user(user)
    from berth.shared.messages import QuotaSet

    event = QuotaSet(user=who, quota=q, by=local_user() or "", ts=time.time())
    _admin_publish(ctx, subjects.ADMIN_QUOTAS, event, f"quota:{who}:{time.time_ns()}")
    shown = ", ".join(f"{k} {v}" for k, v in (("cpu", _cores(q.cpu)),
                                              ("memory_mb", _n(q.mem)),
                                              ("devices", _n(q.dev))))
    print(f"quota of {user if who else 'every user (default)'}: {shown} ('-': "
          f"{'the default' if who else 'no limit'})")


@quota.command("list")
def cmd_quota_list(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """The default quota and each user's, with what their running tasks hold."""
    data = _limits(ctx)
    rows = [data["default"], *data["users"]]
    if as_json:
        print_json(rows)
        return
    out = console()
    out.print("USER  CPU(used/limit)  MEMORY_MB(used/limit)  DEVICES(used/limit)")
    for r in rows:
        out.print(f"{r['user']}  {_cores(r['cpu_used'])}/{_cores(r['cpu'])}  "
                  f"{r['mem_used']}/{_n(r['mem'])}  {r['dev_used']}/{_n(r['dev'])}")


@tokens.command("set")
def cmd_tokens_set(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="the token's name")],
    limit: Annotated[int, typer.Argument(help="how many may be held at once")],
) -> None:
    """Set how many of token NAME running tasks may hold at once. Lowering it stops
    nothing: no task asking for it starts until its use is under the limit."""
    check_token_name(name)
    if limit < 0:
        fail(f"LIMIT: {limit} is not a limit (0 or more)")
    from berth.shared.messages import TokenLimitSet

    event = TokenLimitSet(name=name, limit=limit, by=local_user() or "", ts=time.time())
    _admin_publish(ctx, subjects.admin_tokens(name), event, f"token:{name}:{time.time_ns()}")
    print(f"token {name}: limit {limit}")


@tokens.command("list")
def cmd_tokens_list(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Every token: its limit and how many running tasks hold."""
    rows = _limits(ctx)["tokens"]
    if as_json:
        print_json(rows)
        return
    out = console()
    out.print("NAME  IN_USE/LIMIT")
    for r in rows:
        out.print(f"{r['name']}  {r['in_use']}/{r['limit']}")


def register(app: typer.Typer) -> None:
    app.add_typer(quota)
    app.add_typer(tokens)
