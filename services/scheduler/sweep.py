"""The sweep: the pending reasons and scheduling timeouts of the waiting tasks that a tick's
walk of the queue never reaches (docs/placement.md, "A walk stopped once the capacity is
gone").

A tick's walk stops once the free capacity left is below what any waiting task needs; the
tasks behind that point are not looked at. Once every SWEEP_EVERY seconds one tick used to
walk the whole queue instead, to give each of them its reason and judge its timeout: at
10,000 hosts with 150,000 tasks waiting that one walk held the event loop ~2 s, past the
lease's renewal, and the leader lost its lease in the middle of a burst
(docs/performance.md). A sweep looks at the same tasks a slice at a time instead: it takes
the jobs waiting when it starts, and each tick while it lasts whose walk stopped short looks
at the next SWEEP_TASKS of their tasks, on the hosts as they are then. A walk cut short by
its limit of placements leaves the slice to a later tick (the tasks behind it are about to
be placed, not waiting for room); a walk that looked at every unit ends the sweep.

What a slice finds is what the whole walk would have found on a full cluster, where the
walk stops short (nothing in it is placed, so order does not matter). Where room frees up
meanwhile, a slice may find a task placeable that the queue's earlier tasks would take the
room from: it gives that task no reason and does not time it out, and the ticks place it
or reach it. So a sweep never times out a task that a walk of the whole queue would have
placed.

Pure bookkeeping: the leader (services/scheduler/service.py) builds the units and places
them."""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping

# Seconds from one sweep's start to the next one's (a sweep still running is not restarted).
SWEEP_EVERY = 10.0
# Waiting tasks a tick's slice of a sweep looks at, at most (a whole job's, though it goes
# over): ~60 ms of the event loop on a 2-core machine, with the lease renewed every second.
SWEEP_TASKS = 5000


class Sweep:
    """The jobs one sweep has still to look at, in the order they were filed."""

    def __init__(self, jobs: list[str]) -> None:
        self.jobs = jobs
        self.at = 0  # jobs[:at] are looked at

    @property
    def done(self) -> bool:
        return self.at >= len(self.jobs)

    def take(self, pending: Mapping[str, object], reached: Container[str],
             count: Callable[[str], int], budget: int = SWEEP_TASKS) -> list[str]:
        """The next jobs to look at, up to `budget` tasks: of those still in `pending` (by
        job id), the ones this tick's walk has not `reached` (it saw them already)."""
        jobs, taken, tasks = self.jobs, [], 0
        while self.at < len(jobs) and tasks < budget:
            job_id = jobs[self.at]
            self.at += 1
            if job_id in pending and job_id not in reached:
                taken.append(job_id)
                tasks += count(job_id)
        return taken
