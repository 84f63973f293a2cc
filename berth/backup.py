"""Backing up and restoring the events stream, the source of truth: every job, task,
attempt and worker transition. A backup is JSON lines, one message each (sequence, subject,
headers, body), written while berth runs; a restore replays them, in order and with their
sequences, into an empty stream, so every fold of the restored stream is the fold of the
original."""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated

import typer

from berth.cli_app import fail, globals_of
from berth.creds_cli import cli_connection, cli_credentials
from berth.shared import subjects
from berth.shared.config import Settings

if TYPE_CHECKING:
    from nats.js import JetStreamContext

# The NATS client is imported by the backup and the restore themselves, not by every
# `berth` command (each imports this module to register these two).

FORMAT = "berth-events-backup/1"


class BackupError(Exception):
    """A backup that cannot be made or restored; the message says why."""


async def backup(js: JetStreamContext, out: IO[str]) -> int:
    """Writes every event up to the stream's last sequence now; returns how many."""
    from berth.shared import nats_io

    last = await _newest_seq(js)
    out.write(json.dumps({"format": FORMAT, "stream": subjects.EVENTS_STREAM,
                          "last_seq": last}) + "\n")
    if last == 0:
        return 0
    count = 0
    events = nats_io.follow_raw_events(js)
    try:
        async for raw in events:
            out.write(json.dumps({"seq": raw.seq, "subject": raw.subject,
                                  "headers": dict(raw.headers),
                                  "data": base64.b64encode(raw.data).decode()}) + "\n")
            count += 1
            if raw.seq >= last:
                break
    finally:
        await events.aclose()
    return count


async def _newest_seq(js: JetStreamContext) -> int:
    """The sequence of the newest message the stream holds: past compaction
    (docs/retention.md) the stream's last sequence may be one purged since."""
    import nats.js.errors

    try:
        newest = await js.get_last_msg(subjects.EVENTS_STREAM, subjects.EVENTS_ALL)
    except nats.js.errors.NotFoundError:
        return 0
    return int(newest.seq or 0)


def read_backup(lines: Iterator[str]) -> Iterator[dict[str, object]]:
    header = json.loads(next(lines, "{}") or "{}")
    if header.get("format") != FORMAT:
        raise BackupError(f"not a berth events backup (format {header.get('format')!r})")
    for number, line in enumerate(lines, start=2):
        try:
            yield json.loads(line)
        except ValueError as exc:
            raise BackupError(f"line {number}: not JSON ({exc})") from None


async def restore(js: JetStreamContext, lines: Iterator[str]) -> int:
    """Replays a backup into the events stream, which must be empty: each message lands at
    the sequence it had (JetStream refuses it otherwise), so nothing can interleave."""
    from berth.shared import nats_io

    if (last := await nats_io.last_event_seq(js)) != 0:
        raise BackupError(f"the events stream already holds {last} events; restore only "
                          "into a new cluster's empty stream")
    count = stored = 0
    for record in read_backup(lines):
        seq = int(str(record["seq"]))
        # Sequences compaction purged (docs/retention.md) stay gaps: each is taken by a
        # placeholder, deleted at once (no service is reading yet).
        for gap in range(stored + 1, seq):
            await _put(js, subjects.RESTORE_GAP, b"", {}, gap)
            await js.delete_msg(subjects.EVENTS_STREAM, gap)
        headers = {str(k): str(v) for k, v in dict(record["headers"]).items()}  # type: ignore[call-overload]
        await _put(js, str(record["subject"]), base64.b64decode(str(record["data"])), headers,
                   seq)
        count, stored = count + 1, seq
    return count


async def _put(js: JetStreamContext, subject: str, data: bytes, headers: dict[str, str],
               seq: int) -> None:
    """Stores one message at sequence `seq`, or says why it cannot be."""
    import nats.js.errors

    headers = {**headers, "Nats-Expected-Last-Sequence": str(seq - 1)}
    try:
        ack = await js.publish(subject, data, headers=headers, stream=subjects.EVENTS_STREAM)
    except nats.js.errors.APIError as exc:
        raise BackupError(f"event {seq} could not be restored in place: {exc}") from None
    if ack.seq != seq:
        raise BackupError(f"event {seq} landed at {ack.seq}")


def open_lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        yield from f


def cmd_backup(ctx: typer.Context,
               file: Annotated[str, typer.Argument(help="the file to write (JSON lines)")]
               ) -> int:
    """Copy the events stream (every job and its history) to a file.

    Writes every event of BERTH_EVENTS, the source of truth, to FILE (JSON lines), while
    berth runs. Submits not yet decided are not in it. Needs admin credentials
    (BERTH_NATS_CREDS, or a local `berth up`'s)."""
    import asyncio

    where = globals_of(ctx)
    url = where.nats_url()
    creds = cli_credentials(where.data_dir, admin=True)

    async def run(out: IO[str]) -> int:
        async with cli_connection(url, creds) as nc:
            return await backup(nc.jetstream(), out)

    try:
        with open(file, "w", encoding="utf-8") as out:
            count = asyncio.run(run(out))
    except OSError as exc:
        fail(str(exc))
    print(f"backed up {count} events to {file}", file=sys.stderr)
    return 0


def cmd_restore(ctx: typer.Context,
                file: Annotated[str, typer.Argument(help="a file `berth backup` wrote")]
                ) -> int:
    """Replay a backup into a new cluster's empty events stream.

    Replays FILE, made by `berth backup`, into an empty BERTH_EVENTS with every event at its
    original sequence; start the services afterwards and they fold it as they would the
    original. Refuses a stream that already holds events."""
    import asyncio

    where = globals_of(ctx)
    url = where.nats_url()
    creds = cli_credentials(where.data_dir, admin=True)

    async def run() -> int:
        from berth.shared import nats_io

        async with cli_connection(url, creds) as nc:
            js = nc.jetstream()
            # Into a NATS cluster: as many copies as its services keep (BERTH_STREAM_REPLICAS).
            await nats_io.ensure_streams(js, Settings.from_env().stream_replicas)
            return await restore(js, open_lines(Path(file)))

    try:
        count = asyncio.run(run())
    except (BackupError, OSError) as exc:
        fail(str(exc))
    print(f"restored {count} events from {file}", file=sys.stderr)
    return 0


def register(app: typer.Typer) -> None:
    app.command("backup")(cmd_backup)
    app.command("restore")(cmd_restore)
