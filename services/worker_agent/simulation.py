"""Simulated hosts: many worker agents in one process, each speaking exactly the real worker
protocol (register, heartbeat, run and kill commands, BUILDING/RUNNING/exit reports), with
a task's run time drawn from a distribution instead of a process. The scheduler, submitter
and dashboard cannot tell them from real workers. As kube-scheduler's KWOK nodes and
Armada's fake executor do, this measures the real control plane at a scale no test machine
has hosts for."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

from berth.shared.messages import Resources, ResourceUse

SIGNAL_KILLED = -15


@dataclass(frozen=True)
class RunTime:
    """A distribution of task run times, in seconds: `const:S`, `uniform:A:B`, `exp:MEAN`
    or `lognormal:MU:SIGMA` (of the log)."""

    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, text: str) -> RunTime:
        kind, _, rest = text.partition(":")
        arity = {"const": 1, "uniform": 2, "exp": 1, "lognormal": 2}
        if kind not in arity:
            raise ValueError(f"{text!r}: the distribution is one of "
                             f"{', '.join(arity)} (e.g. exp:2.0)")
        try:
            params = tuple(float(p) for p in rest.split(":")) if rest else ()
        except ValueError:
            raise ValueError(f"{text!r}: parameters must be numbers") from None
        if len(params) != arity[kind]:
            raise ValueError(f"{text!r}: {kind} takes {arity[kind]} parameter(s)")
        if any(p < 0 for p in params) and kind != "lognormal":
            raise ValueError(f"{text!r}: parameters must not be negative")
        return cls(kind, params)

    def draw(self, rng: random.Random) -> float:
        p = self.params
        if self.kind == "const":
            return p[0]
        if self.kind == "uniform":
            return rng.uniform(p[0], p[1])
        if self.kind == "exp":
            return rng.expovariate(1 / p[0]) if p[0] > 0 else 0.0
        return rng.lognormvariate(p[0], p[1])


@dataclass(frozen=True)
class SimulatedHost:
    worker_id: str
    resources: Resources
    attributes: dict[str, str]


def simulated_hosts(prefix: str, count: int, resources: Resources,
                    attributes: dict[str, str], slice_size: int = 0) -> list[SimulatedHost]:
    """`count` hosts named `<prefix>-00000`...; with `slice_size`, consecutive hosts form
    slices: `tpu-name=<prefix>-slice-K` and `tpu-worker-id` 0..slice_size-1."""
    width = max(5, len(str(count - 1)))
    hosts = []
    for i in range(count):
        attrs = dict(attributes)
        if slice_size:
            attrs["tpu-name"] = f"{prefix}-slice-{i // slice_size}"
            attrs["tpu-worker-id"] = str(i % slice_size)
        hosts.append(SimulatedHost(f"{prefix}-{i:0{width}d}", resources, attrs))
    return hosts


class SimulatedProcess:
    """Stands in for AttemptProcess: "runs" for a drawn time, then exits with `exit_code`;
    a stop ends it at once as if by SIGTERM."""

    pid: int | None = None

    def __init__(self, duration: float, exit_code: int) -> None:
        self.duration = duration
        self.exit_code = exit_code
        # Its exit code once it has "exited": set by its timer, or by a stop. A future and
        # a timer, not a timed wait on an event (asyncio.timeout raises and catches two
        # exceptions per timeout): thousands of these end each second in a benchmark.
        self._exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._timer: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        if not self._exited.done():  # not stopped before it started
            self._timer = asyncio.get_running_loop().call_later(self.duration, self._end,
                                                                self.exit_code)

    def _end(self, code: int) -> None:
        # The timer's handle holds this method, so this object: a cycle, left to the
        # collector. 20,000 of them in W1 made the simulated hosts' process collect every
        # ~1.5 s, 30-50 ms each (docs/performance.md).
        self._timer = None
        if not self._exited.done():
            self._exited.set_result(code)

    async def wait(self) -> int:
        return await self._exited

    async def stop(self, grace: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._end(SIGNAL_KILLED)

    def renew(self, deadline: float) -> None:
        return None  # nothing runs, so nothing needs fencing

    @property
    def fenced(self) -> str:
        return ""

    @property
    def usage(self) -> ResourceUse | None:
        return None  # nothing runs, so nothing is measured


def process_factory(run_time: RunTime, fail_rate: float, seed: int | None = None
                    ) -> Callable[[], SimulatedProcess]:
    rng = random.Random(seed)

    def make() -> SimulatedProcess:
        exit_code = 1 if fail_rate and rng.random() < fail_rate else 0
        return SimulatedProcess(run_time.draw(rng), exit_code)

    return make
