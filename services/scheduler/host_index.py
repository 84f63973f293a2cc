"""The live hosts as placement sees them, kept between ticks by a caller that knows which
changed (the scheduler, from its fold's `workers_changed`), with what each call to
`placement.place` would otherwise rebuild from every host:

- the hosts that take any work, ranked by most free cpu, then worker id: the order a single
  task without constraints or devices takes them in. A call reads it from the top only
  as far as it places (placement._Ranked), where it built a heap of every host;
- the hosts held for a preemptor, by preemptor;
- the free capacity summed over every host, and the most any one host has free in each
  dimension (a count of hosts by free amount, per dimension): a need beyond it fits
  nowhere, so a tick leaves the jobs of that need out of its walk.

At 10,000 hosts and 200 jobs/s those passes over every host, with the scheduler's own
comparison of every worker to its cached host, were ~45 % of the scheduler's CPU (py-spy,
docs/performance.md): each tick placed a few tasks and visited every host four times.

A host put here is normalised once (its free devices sorted, and counted no higher than
listed), so a call need not look at every host for that either. `place` changes hosts while
it runs and puts them back before it returns: between calls each one is as put here."""

from __future__ import annotations

import bisect
from collections import Counter

import msgspec

from berth.services.scheduler.placement import Host, normalise, takes_any_work, unnormalised
from berth.shared.capacity import DIMENSIONS, Amounts

# (0, -free cpu, worker id): a heap entry of placement's without its host, so the two
# compare directly (worker ids are unique: the host is never reached).
Rank = tuple[int, int, str]


def rank(host: Host) -> Rank:
    """Where a host comes among those taking any work: most free cpu first."""
    return (0, -host.free.cpu, host.worker_id)


class HostIndex:
    def __init__(self) -> None:
        self.hosts: dict[str, Host] = {}
        # rank(host) of every host taking any work, in order; rank_of: each one's rank.
        self.ranked: list[Rank] = []
        self.rank_of: dict[str, Rank] = {}
        self.held: dict[str, dict[str, Host]] = {}  # preemptor -> its hosts by worker id
        self.total = Amounts()
        # Per dimension (cpu, mem, disk, dev): how many hosts have each amount free.
        self.frees: tuple[Counter[int], ...] = tuple(Counter() for _ in DIMENSIONS)
        self._listed: list[Host] | None = None

    def update(self, changed: dict[str, Host | None]) -> None:
        """Puts each changed worker's new host, or removes it (None: the worker is dead).
        When many changed (a tick of 1,000 placements changes most hosts of 1,000), the
        ranking is made again at once: the unchanged ranks, still in order, and the changed
        ones sorted, merged by one sort of the two runs (Timsort merges them in one pass).
        A bisect each was slower than that, and a sort of every rank slower still."""
        many = len(changed) * 8 > len(self.hosts)
        for worker_id, host in changed.items():
            if host is None:
                self.remove(worker_id, keep_ranked=not many)
            else:
                self.put(host, keep_ranked=not many)
        if many:
            rank_of = self.rank_of
            ranked = [r for r in self.ranked if r[2] not in changed]
            ranked += sorted(rank_of[w] for w in changed if w in rank_of)
            ranked.sort()
            self.ranked = ranked

    def put(self, host: Host, keep_ranked: bool = True) -> None:
        """Adds the host, or replaces the one of its worker id (keeping its place).
        `keep_ranked`=False: the caller makes `ranked` again after (update)."""
        if unnormalised(host):
            normalise(host)
        self._drop(host.worker_id, keep_ranked)
        self.hosts[host.worker_id] = host
        self.total = self.total + host.free
        for counts, amount in zip(self.frees, msgspec.structs.astuple(host.free), strict=True):
            counts[amount] += 1
        if takes_any_work(host):
            key = self.rank_of[host.worker_id] = rank(host)
            if keep_ranked:
                bisect.insort(self.ranked, key)
        elif host.held_for is not None:
            self.held.setdefault(host.held_for, {})[host.worker_id] = host

    def remove(self, worker_id: str, keep_ranked: bool = True) -> None:
        """Takes the worker's host out (a dead worker); nothing if it has none."""
        if self._drop(worker_id, keep_ranked):
            del self.hosts[worker_id]

    def listed(self) -> list[Host]:
        """Every host, in the order first put: the same list object until one changes (so
        idle_tick can tell an unchanged cluster by identity, without a look at each)."""
        if self._listed is None:
            self._listed = list(self.hosts.values())
        return self._listed

    def most_free(self) -> Amounts:
        """The most any one host has free, in each dimension (each maybe of another host):
        no more than a host can give any task."""
        return Amounts(*(max(counts, default=0) for counts in self.frees))

    def held_by_job(self) -> dict[str, list[Host]]:
        return {job_id: list(hosts.values()) for job_id, hosts in self.held.items()}

    def _drop(self, worker_id: str, keep_ranked: bool) -> bool:
        """Undoes what putting the worker's current host added; whether it had one."""
        old = self.hosts.get(worker_id)
        self._listed = None
        if old is None:
            return False
        self.total = self.total - old.free
        for counts, amount in zip(self.frees, msgspec.structs.astuple(old.free), strict=True):
            if counts[amount] == 1:
                del counts[amount]
            else:
                counts[amount] -= 1
        key = self.rank_of.pop(worker_id, None)
        if key is not None:
            if keep_ranked:
                del self.ranked[bisect.bisect_left(self.ranked, key)]
        elif old.held_for is not None:
            held = self.held[old.held_for]
            del held[worker_id]
            if not held:
                del self.held[old.held_for]
        return True
