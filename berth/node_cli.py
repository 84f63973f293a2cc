"""`berth cordon / drain / uncordon WORKER`: an operator takes a worker out of service or
returns it (docs/operations.md, "Node health"). Each is one NodeHealthChanged, published
as the admin identity on the worker's verdict subject (where the worker itself may not
write), so the event log records who did what and why. Plain functions of their inputs, so
any command-line front end can call them."""

from __future__ import annotations

import math
import sys
import time
import uuid
from typing import TYPE_CHECKING, Annotated

import typer

from berth.cli_app import globals_of
from berth.client import ApiError, api_get
from berth.creds_cli import cli_connection, cli_credentials, local_user
from berth.shared import subjects

if TYPE_CHECKING:
    from berth.shared.credentials import Credentials
    from berth.shared.messages import NodeAction, NodeHealthChanged

# The messages and asyncio are imported by these commands themselves, not by every `berth`
# command (each imports this module to register them).

# A drain's default deadline: long enough for most work to finish by itself.
DEFAULT_DRAIN_DEADLINE = 3600.0


async def _publish(nats_url: str, creds: Credentials, event: NodeHealthChanged) -> None:
    from berth.shared import nats_io

    async with cli_connection(nats_url, creds) as nc:
        await nats_io.publish_event(
            nc.jetstream(), subjects.worker_verdicts(event.worker_id), event,
            msg_id=f"node:{event.worker_id}:{event.action.value}:{uuid.uuid4().hex}")


def node_health(nats_url: str, api_url: str, data_dir: str, worker_id: str,
                action: NodeAction, reason: str = "", deadline: float | None = None) -> int:
    """Publishes one operator action on `worker_id`; the command's exit status. `deadline`
    (seconds from now) is a drain's."""
    import asyncio

    from berth.shared.messages import NodeAction, NodeHealthChanged

    if deadline is not None and not (math.isfinite(deadline) and deadline >= 0):
        print(f"berth: deadline: {deadline:g} is not a number of seconds, 0 or more",
              file=sys.stderr)
        return 1
    try:
        api_get(api_url, f"/api/workers/{worker_id}")
    except ApiError as exc:
        print(f"berth: worker {worker_id}: {exc}", file=sys.stderr)
        return 1
    now = time.time()
    event = NodeHealthChanged(
        worker_id=worker_id, action=action, reason=reason, by=local_user() or "",
        deadline=None if deadline is None else now + deadline, ts=now)
    asyncio.run(_publish(nats_url, cli_credentials(data_dir, admin=True), event))
    match action:
        case NodeAction.CORDON:
            print(f"{worker_id} cordoned: it takes no new work; what runs there runs on")
        case NodeAction.DRAIN:
            print(f"{worker_id} draining: it takes no new work; what still runs there in "
                  f"{deadline:g}s is preempted (retried elsewhere)")
        case _:
            print(f"{worker_id} returned to service")
    return 0


WorkerArg = Annotated[str, typer.Argument(help="worker id (`berth workers` lists them)")]
ReasonOption = Annotated[str, typer.Option(help="recorded in the event log")]


def cordon(ctx: typer.Context, worker: WorkerArg, reason: ReasonOption = "") -> int:
    """The worker takes no new work; what runs there runs on (docs/operations.md)."""
    from berth.shared.messages import NodeAction

    where = globals_of(ctx)
    return node_health(where.nats_url(), where.api_url(), where.data_dir, worker,
                       NodeAction.CORDON, reason)


def drain(ctx: typer.Context, worker: WorkerArg, reason: ReasonOption = "",
          deadline: Annotated[float, typer.Option(
              help="seconds to wait for running work")] = DEFAULT_DRAIN_DEADLINE) -> int:
    """The worker takes no new work; what still runs there at the deadline is preempted
    (retried elsewhere; docs/operations.md)."""
    from berth.shared.messages import NodeAction

    where = globals_of(ctx)
    return node_health(where.nats_url(), where.api_url(), where.data_dir, worker,
                       NodeAction.DRAIN, reason, deadline)


def uncordon(ctx: typer.Context, worker: WorkerArg, reason: ReasonOption = "") -> int:
    """Return a cordoned, drained or quarantined worker to service (docs/operations.md)."""
    from berth.shared.messages import NodeAction

    where = globals_of(ctx)
    return node_health(where.nats_url(), where.api_url(), where.data_dir, worker,
                       NodeAction.UNCORDON, reason)


def register(app: typer.Typer) -> None:
    for command in (cordon, drain, uncordon):
        app.command()(command)
