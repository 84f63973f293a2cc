"""Pending work in placement order, kept between ticks.

shared/queue_order.py says what the order is: band, then the fair-share key (the user's
recent use plus the charges of the user's earlier waiting jobs in the band), then
submission. Building that order from scratch grouped, keyed and sorted every pending task
on every tick: at 10,000 hosts with 140,000 tasks waiting that was most of a tick, the
event loop was held past the lease's renewal, and the leader lost its lease again and
again (docs/performance.md, "A tick that costs what it places").

This index gives the same order at the cost of what changed plus what a tick takes:

- the pending tasks are diffed against the last tick's with set operations (in C), and only
  the difference is filed;
- each (band, user) keeps its jobs in submission order. Within one, the fair-share keys
  only grow (each job's charge is >= 0), so the whole order is a merge of these queues by
  (band, key, submission), done lazily with a heap: a tick that stops after 1,000
  placements looks at about 1,000 jobs, however many wait.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

Key = tuple[str, int]  # (job id, task index), as ClusterState.pending has them


@dataclass(frozen=True, slots=True)
class Place:
    """Where a job stands in the order, whatever its pending tasks: fixed by its spec."""

    band: int
    user: str
    seq: int


@dataclass
class _Queue:
    """One (band, user)'s jobs in submission order. Entries of jobs with no task pending any
    more are dropped lazily: from the front as the queue is read, and all at once when they
    outnumber the live ones."""

    entries: list[tuple[int, str]] = field(default_factory=list)  # (seq, job id), sorted
    start: int = 0  # every entry before it is of a job with nothing pending
    live: int = 0  # entries of jobs with a task pending


class PendingQueue:
    def __init__(self) -> None:
        self.known: set[Key] = set()
        # Job -> its pending task indices; a job is here while one is pending.
        self.indices: dict[str, set[int]] = {}
        self.places: dict[str, Place] = {}
        self.queues: dict[tuple[int, str], _Queue] = {}
        self.listed: set[str] = set()  # jobs with an entry in their queue, live or not

    def sync(self, pending: Mapping[Key, object], place_of: Callable[[str], Place]) -> None:
        """Files what changed in `pending` (ClusterState.pending) since the last call."""
        keys = pending.keys()
        added = keys - self.known
        removed = self.known - keys
        self.known -= removed
        self.known |= added
        thinned: set[tuple[int, str]] = set()
        for job_id, index in removed:
            tasks = self.indices[job_id]
            tasks.discard(index)
            if not tasks:
                del self.indices[job_id]
                where = self.places[job_id]
                self.queues[(where.band, where.user)].live -= 1
                thinned.add((where.band, where.user))
        for job_id, index in added:
            filed = self.indices.get(job_id)
            if filed is None:
                filed = self.indices[job_id] = set()
                self._file(job_id, place_of)
            filed.add(index)
        for name in thinned:
            queue = self.queues[name]
            if len(queue.entries) - queue.start > 2 * queue.live + 64:
                self._compact(queue)

    def _file(self, job_id: str, place_of: Callable[[str], Place]) -> None:
        where = self.places.get(job_id)
        if where is None:
            where = self.places[job_id] = place_of(job_id)
        queue = self.queues.setdefault((where.band, where.user), _Queue())
        queue.live += 1
        entry = (where.seq, job_id)
        at = bisect.bisect_left(queue.entries, entry)
        if job_id not in self.listed:
            queue.entries.insert(at, entry)  # at the end, unless it is a requeued task's
            self.listed.add(job_id)
        queue.start = min(queue.start, at)

    def _compact(self, queue: _Queue) -> None:
        kept = []
        for entry in queue.entries:
            if entry[1] in self.indices:
                kept.append(entry)
            else:  # filed afresh (place_of) if a task of it waits again
                self.listed.discard(entry[1])
                self.places.pop(entry[1], None)
        queue.entries = kept
        queue.start = 0

    def _live(self, queue: _Queue) -> Iterator[tuple[int, str]]:
        entries = queue.entries
        i = queue.start
        while i < len(entries) and entries[i][1] not in self.indices:
            i += 1
        if i > 4096 and i > len(entries) // 2:  # a consumed front: drop it
            for _, job_id in entries[:i]:
                self.listed.discard(job_id)
                self.places.pop(job_id, None)
            del entries[:i]
            i = 0
        queue.start = i
        for k in range(i, len(entries)):
            if entries[k][1] in self.indices:
                yield entries[k]

    def ordered(self, used: Mapping[str, float],
                charge: Callable[[str], float | None]) -> Iterator[str]:
        """Jobs with pending tasks in placement order. `used` is each user's recent use;
        `charge(job)` is what the job's pending tasks add to its user's key, or None to
        leave it out (all its pending tasks wait out a backoff): it then adds nothing.
        Read it within one synchronous stretch: it must not outlive a `sync`."""
        heap: list[tuple[int, float, int, str, Iterator[tuple[int, str]]]] = []
        for (band, user), queue in self.queues.items():
            if not queue.live:
                continue
            jobs = self._live(queue)
            first = next(jobs, None)
            if first is not None:
                heap.append((band, used.get(user, 0.0), first[0], first[1], jobs))
        heapq.heapify(heap)
        while heap:
            band, key, _, job_id, jobs = heap[0]
            added = charge(job_id)
            if added is not None:
                yield job_id
                key += added
            following = next(jobs, None)
            if following is None:
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (band, key, following[0], following[1], jobs))
