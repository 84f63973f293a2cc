"""W5's scheduler-side steps alone, without the rest of the stack sharing the cores: 1,000
hosts in 125 slices of 8, each slice held by a batch gang; 100 production gangs of 8 wait.
Times, on the real valkey: planning the evictions (services/scheduler/preemption.py),
committing them with preempt.lua one call per preemptor (as before) and one call for the
whole tick (preempt_many), and the placement tick once the victims are gone
(services/scheduler/placement.py). docs/performance.md, "Preemption: W5".

    .venv/bin/python bench/w5_tick.py [--slices 125] [--gangs 100] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from berth.services.scheduler import placement, preemption
from berth.shared import redis_auth, redis_io, servers
from berth.shared.capacity import Amounts, GroupClaim
from berth.shared.messages import Coscheduling
from berth.shared.reservations import Eviction, Reservation, ReservationStore

SIZE = 8
HOST = Amounts(4000, 4096, 0, 4)
NEED = Amounts(1000, 100, 0, 4)
KIND = "tpu:v5p:2x2x1"
GANG = Coscheduling(group_by="tpu-name", order_by="tpu-worker-id")


def worker(s: int, i: int) -> str:
    return f"sim-{s * SIZE + i:05d}"


def hosts(slices: int, holder: bool, held: dict[str, str]) -> list[placement.Host]:
    return [placement.Host(
        worker(s, i), HOST - NEED if holder else HOST, KIND,
        {"tpu-name": f"slice-{s}", "tpu-worker-id": str(i)}, "127.0.0.1",
        f"batch{s}" if holder else None, set(), None, "", held.get(worker(s, i)))
        for s in range(slices) for i in range(SIZE)]


def units(prefix: str, count: int) -> list[placement.Unit]:
    return [placement.Unit(f"{prefix}{g}", tuple(range(SIZE)), NEED, KIND, (), (), GANG)
            for g in range(count)]


async def fill(store: ReservationStore, epoch: int, slices: int) -> None:
    for s in range(slices):
        members = tuple(worker(s, i) for i in range(SIZE))
        await store.reserve(epoch, [
            Reservation(w, f"batch{s}/{i}/0", f"batch{s}", NEED, KIND, (), f"tpu-name=slice-{s}")
            for i, w in enumerate(members)], [GroupClaim(f"tpu-name=slice-{s}", f"batch{s}",
                                                         members)])


async def run(slices: int, gangs: int, repeat: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="berth-w5-tick-") as tmp:
        redis = servers.start_redis(Path(tmp))
        client = redis_io.connect(redis.url_for(redis_auth.SCHEDULER))
        admin = redis_io.connect(redis.url_for(redis_auth.ADMIN))
        try:
            store = ReservationStore(client)
            running = [preemption.Running(f"batch{s}/{i}/0", f"batch{s}", worker(s, i), 2,
                                          NEED, True, True, float(s))
                       for s in range(slices) for i in range(SIZE)]
            started = time.perf_counter()
            plans = preemption.plan([(u, 0) for u in units("prod", gangs)],
                                    hosts(slices, True, {}), running, limit=200)
            planning = time.perf_counter() - started
            where = {r.key: r.worker_id for r in running}
            evictions = [Eviction(p.job_id, p.hosts, tuple((where[k], k) for k in p.victims),
                                  p.needs) for p in plans]
            one_by_one, batched = [], []
            for _ in range(repeat):
                for timings, batch in ((one_by_one, False), (batched, True)):
                    await admin.flushdb()
                    epoch = await store.acquire_lease("bench", 60_000)
                    for h in hosts(slices, False, {}):
                        await store.register_host(epoch, h.worker_id, HOST, KIND)
                    await fill(store, epoch, slices)
                    started = time.perf_counter()
                    if batch:
                        assert not any(await store.preempt_many(epoch, evictions))
                    else:
                        for e in evictions:
                            await store.preempt(epoch, e)
                    timings.append(time.perf_counter() - started)
            held = {w: p.job_id for p in plans for w in p.hosts}
            victims = {p.victims[0].split("/")[0] for p in plans}
            free = [h for h in hosts(slices, True, held)]
            for h in free:  # the victims are gone: their slices are free, and held
                if h.holder in victims:
                    h.holder, h.free = None, HOST
            waiting = units("prod", gangs) + [
                u for u in units("batch", slices) if u.job_id in victims]
            started = time.perf_counter()
            placed = placement.place(waiting, free, limit=1000)
            placing = time.perf_counter() - started
        finally:
            await client.aclose()
            await admin.aclose()
            redis.stop()
    return {
        "slices": slices, "gangs": gangs, "evictions": len(plans),
        "plan_s": round(planning, 3),
        "commit_one_call_per_preemptor_s": round(statistics.median(one_by_one), 3),
        "commit_one_call_per_tick_s": round(statistics.median(batched), 3),
        "place_after_exits_s": round(placing, 3), "placed_tasks": len(placed.assignments),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slices", type=int, default=125)
    parser.add_argument("--gangs", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.slices, args.gangs, args.repeat))))


if __name__ == "__main__":
    main()
