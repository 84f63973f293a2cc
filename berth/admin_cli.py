"""`berth admin compact`: asks the leader to compact finished jobs out of the events stream
now (docs/retention.md), instead of waiting for its periodic run. Speaks as the admin
identity; the leader alone compacts, fenced by its lease."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from berth.cli_app import globals_of
from berth.creds_cli import cli_connection, cli_credentials
from berth.shared import durations, subjects

admin = typer.Typer(name="admin", no_args_is_help=True,
                    help="Operator actions on the whole cluster.")

# Compacting a large backlog is many purges; the leader answers when it is done.
REPLY_TIMEOUT = 120.0


async def _ask(nats_url: str, data_dir: str, older_than: float) -> bytes:
    import nats.errors

    from berth.shared.messages import CompactRequest, encode

    async with cli_connection(nats_url, cli_credentials(data_dir, admin=True)) as nc:
        try:
            msg = await nc.request(subjects.ADMIN_COMPACT,
                                   encode(CompactRequest(older_than=older_than)),
                                   timeout=REPLY_TIMEOUT)
        except nats.errors.NoRespondersError:
            raise SystemExit("berth: admin compact: no scheduler is leading") from None
        except nats.errors.TimeoutError:
            raise SystemExit(f"berth: admin compact: no answer from the leader in "
                             f"{REPLY_TIMEOUT:g}s") from None
        return msg.data


@admin.command()
def compact(ctx: typer.Context, older_than: Annotated[str, typer.Option(
        "--older-than", help="compact jobs finished at least this long ago (default: "
        "BERTH_JOB_RETENTION): seconds, or a number with s, m, h or d")] = "") -> int:
    """Compact finished jobs out of the events stream now (docs/retention.md)."""
    import asyncio

    from berth.shared.config import Settings
    from berth.shared.messages import CompactReply, decode

    try:
        seconds = (durations.parse(older_than) if older_than
                   else Settings.from_env().job_retention)
    except ValueError as exc:
        print(f"berth: --older-than: {exc}", file=sys.stderr)
        return 2
    import msgspec

    where = globals_of(ctx)
    reply = decode(msgspec.json.Decoder(CompactReply),
                   asyncio.run(_ask(where.nats_url(), where.data_dir, seconds)))
    if reply.error:
        print(f"berth: admin compact: {reply.error}", file=sys.stderr)
        return 1
    print(f"compacted {reply.jobs} jobs finished more than {durations.show(seconds)} ago: "
          f"events stream {reply.messages_before} -> {reply.messages_after} messages, "
          f"{reply.bytes_before} -> {reply.bytes_after} bytes")
    return 0


def register(app: typer.Typer) -> None:
    app.add_typer(admin)
