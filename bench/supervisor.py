"""CPU per attempt of starting `true` under its supervisor, without the rest of the worker
agent: exec'd, forked from the zygote for each attempt (`forked`), or forked once and then
taking attempt after attempt (`pooled`, what the agent does: services/worker_agent/zygote.py).

    .venv/bin/python bench/supervisor.py [--attempts 200] [--concurrency 8]

Prints one JSON line per mode: the agent's own CPU per attempt (AttemptProcess's work) and
the supervisor's, its task's included (exec'd: the agent's reaped children; otherwise the
zygote's tree, less the zygote's own start).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import tempfile
import time
from pathlib import Path

from procstat import own_cpu_seconds, tree_cpu_seconds  # bench/procstat.py

from berth.services.worker_agent.process import AttemptProcess
from berth.services.worker_agent.zygote import Zygote


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


async def run(mode: str, attempts: int, concurrency: int, root: Path) -> dict[str, object]:
    zygote = None if mode == "exec" else Zygote(keep_idle=0 if mode == "forked" else 32)

    async def sink(stream: str, chunk: bytes) -> None:
        pass

    async def one() -> None:
        p = AttemptProcess(["true"], dict(os.environ), str(root), sink, time.monotonic() + 60,
                           usage_file=root / f"usage-{os.urandom(4).hex()}", zygote=zygote)
        await p.start()
        if (code := await p.wait()) != 0:
            raise SystemExit(f"{mode}: `true` exited {code}")

    await one()  # the zygote's start is not per attempt
    zygote_pid = zygote.proc.pid if zygote is not None and zygote.proc is not None else 0
    before = (own_cpu_seconds(), children_cpu(),
              tree_cpu_seconds(zygote_pid) if zygote_pid else 0.0)
    started = time.monotonic()
    for _ in range(attempts // concurrency):
        await asyncio.gather(*(one() for _ in range(concurrency)))
    wall = time.monotonic() - started
    done = attempts // concurrency * concurrency
    agent = own_cpu_seconds() - before[0]
    supervisors = (tree_cpu_seconds(zygote_pid) - before[2] if zygote_pid
                   else children_cpu() - before[1])
    if zygote is not None:
        zygote.close()
    return {"mode": mode, "attempts": done,
            "agent_cpu_ms_per_attempt": round(agent / done * 1000, 2),
            "supervisor_cpu_ms_per_attempt": round(supervisors / done * 1000, 2),
            "wall_ms_per_attempt": round(wall / done * 1000, 2)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attempts", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("exec", "forked", "pooled"):
            print(json.dumps(await run(mode, args.attempts, args.concurrency, Path(tmp))),
                  flush=True)


if __name__ == "__main__":
    asyncio.run(main())
