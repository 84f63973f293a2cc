"""How fast one follower reads the events stream (`nats_io.follow_events`), in this process:
the per-message cost every service pays (the scheduler, the dashboard, the benchmarks'
own observers), apart from any fold.

    .venv/bin/python bench/follow.py             # 100,000 events (a W1 of ~16,000 tasks)
    .venv/bin/python bench/follow.py --events 20000
    .venv/bin/python bench/follow.py --raw       # the messages alone, not decoded or checked
    .venv/bin/python bench/follow.py --durable   # as the dashboard reads: a durable pull
                                                 # consumer (DurableEventFeed), not decoded

A real nats-server is filled with the benchmark history of bench/dashboard.py (submits,
assignments, reports), each message with the headers services give it (a dedup id and a
trace context); then it is read from sequence 1, and the CPU seconds of this process
(`time.process_time`, which other load on the machine moves little) and the wall-clock
rate are printed as one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import AsyncGenerator
from pathlib import Path

from dashboard import history  # bench/dashboard.py, beside this script

from berth.shared import nats_io, servers
from berth.shared.durable_feed import DurableEventFeed


async def fill(server: servers.ServerProcess, events: list[tuple[str, bytes]]) -> int:
    nc = await nats_io.connect(server.url, "berth-bench", server.admin_creds())
    js = nc.jetstream()
    await nats_io.ensure_streams(js)
    for i, (subject, data) in enumerate(events):
        await nc.publish(subject, data, headers=nats_io.message_headers(f"bench:{i}"))
        if i % 5000 == 0:
            await nc.flush()
    await nc.flush()
    last = 0
    for _ in range(1200):  # until the server has stored them all (at most 2 minutes)
        last = await nats_io.last_event_seq(js)
        if last >= len(events):
            break
        await asyncio.sleep(0.1)
    await nc.close()
    return last


async def read_all(server: servers.ServerProcess, last: int, how: str) -> dict[str, float]:
    """Reads up to sequence `last`: "events" (decoded and checked), "raw" or "durable"."""
    nc = await nats_io.connect(server.url, "berth-bench", server.admin_creds())
    js = nc.jetstream()

    async def sequences() -> AsyncGenerator[int]:
        """The last sequence read, after each message or (durable) batch."""
        if how == "durable":
            feed = DurableEventFeed(js, "bench-follow")
            batches = feed.batches(0)
            try:
                async for batch in batches:
                    await feed.ack()
                    yield batch[-1].seq
            finally:
                await batches.aclose()
            return
        events: AsyncGenerator[nats_io.RawEvent | nats_io.EventRecord] = (
            nats_io.follow_raw_events if how == "raw" else nats_io.follow_events)(js)
        try:
            async for record in events:
                yield record.seq
        finally:
            await events.aclose()

    reading = sequences()
    cpu, wall = time.process_time(), time.perf_counter()
    async for seq in reading:
        if seq >= last:
            break
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await reading.aclose()
    await nc.close()
    return {"cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
            "cpu_us_per_event": round(1e6 * cpu / last, 1),
            "events_per_s": round(last / wall)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--raw", action="store_true",
                        help="follow_raw_events: the transport alone, no decode or check")
    parser.add_argument("--durable", action="store_true",
                        help="the dashboard's durable pull consumer, not decoded")
    args = parser.parse_args()
    events = history(max(10, args.events // 4), 10)[:args.events]
    with tempfile.TemporaryDirectory(prefix="berth-follow-") as tmp:
        server = servers.start_nats(Path(tmp))
        try:
            last = asyncio.run(fill(server, events))
            how = "durable" if args.durable else "raw" if args.raw else "events"
            result = asyncio.run(read_all(server, last, how))
        finally:
            server.stop()
    name = {"durable": "durable_feed", "raw": "follow_raw_events"}.get(how, "follow_events")
    print(json.dumps({"benchmark": name, "events": last, **result}))


if __name__ == "__main__":
    main()
