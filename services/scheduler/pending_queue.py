"""Pending work in placement order, kept between ticks.

shared/queue_order.py says what the order is: band, then the fair-share key (the user's
recent use plus the charges of the user's earlier waiting jobs in the band), then
submission. Building that order from scratch grouped, keyed and sorted every pending task
on every tick: at 10,000 hosts with 140,000 tasks waiting that was most of a tick, the
event loop was held past the lease's renewal, and the leader lost its lease again and
again (docs/performance.md, "A tick that costs what it places").

This index gives the same order at the cost of what changed plus what a tick takes:

- what entered or left the pending tasks since the last tick is filed, and nothing else:
  the fold records those changes (`ClusterState.pending_changes`, `apply`); a new term's
  fold is filed whole once (`sync`, a diff by set operations, which every tick once did:
  with 150,000 waiting it was a third of a tick at 10,000 hosts);
- each (band, user, need) keeps its jobs in submission order. A user's fair-share key in
  a band only grows (each job's charge is >= 0), so the whole order is a merge of these
  queues by (band, key, submission), done lazily with a heap: a tick that stops after
  1,000 placements looks at about 1,000 jobs, however many wait;
- a tick leaves out the queues of a need no host has room for (`ordered`'s
  `leaving_out`) without a look at their jobs: 150,000 GPU jobs waiting for busy GPUs no
  longer make every tick look at each of them (docs/placement.md).
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Callable, Collection, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import msgspec

from berth.shared.capacity import Amounts
from berth.shared.lifecycle import JobView

Key = tuple[str, int]  # (job id, task index), as ClusterState.pending has them


class Place(msgspec.Struct, frozen=True, gc=False):
    """Where a job stands in the order, whatever its pending tasks: fixed by its spec. Its
    need (one task's) says which of its user's queues in the band it is filed in."""

    band: int
    user: str
    seq: int
    need: Amounts = msgspec.field(default_factory=Amounts)


def place_of(job: JobView) -> Place:
    """A job's place, from its spec (the scheduler builds unit templates only for the jobs a
    tick reaches, not for every job of a burst: W4's peak memory)."""
    return Place(job.spec.priority.rank, job.spec.user, job.submit_seq,
                 job.spec.resources.amounts)


QueueName = tuple[int, str, Amounts]  # (band, user, need)


@dataclass
class _Queue:
    """One (band, user, need)'s jobs in submission order. Entries of jobs with no task
    pending any more are dropped lazily: from the front as the queue is read, and all at
    once when they outnumber the live ones."""

    name: QueueName  # the one copy every job's place refers to
    # Its entries, sorted by (seq, job id): two lists side by side, not a list of pairs (a
    # pair per waiting job was 56 bytes of W4's peak).
    seqs: list[int] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)
    start: int = 0  # every entry before it is of a job with nothing pending
    live: int = 0  # entries of jobs with a task pending

    def position(self, seq: int, job_id: str) -> int:
        """Where (seq, job id) is, or would go, in the sorted entries."""
        seqs, jobs = self.seqs, self.jobs
        at = bisect.bisect_left(seqs, seq)
        while at < len(seqs) and seqs[at] == seq and jobs[at] < job_id:
            at += 1
        return at


class PendingQueue:
    """What it keeps per waiting job is what W4's peak memory is made of (every job of a
    burst waits at once): a job of one pending task keeps its index as a plain int (a set
    of one is 216 bytes), and a job's place is its queue's key, one tuple per queue. Two
    dicts keyed by job say all it knows of a job; a set beside them, of the filed keys or
    of the listed jobs, was ~160 bytes more per waiting job."""

    def __init__(self, need_of: Callable[[str], tuple[Amounts, bool] | None] | None = None
                 ) -> None:
        # What one task of a job needs and whether the job is a gang (None: the job is not
        # known any more), to keep `needs` and `gangs`; without it, both are unknown.
        self.need_of = need_of
        self.needs: Counter[Amounts] = Counter()  # jobs with a task pending, by need
        self.gangs = 0  # gangs with a task pending
        self.needs_known = need_of is not None
        # Job -> its pending task index, or a set of them when more than one is pending; a
        # job is here while one is pending. Read it with `tasks` and `filed`.
        self.indices: dict[str, int | set[int]] = {}
        # Job -> the name of its queue, for a job with an entry in it, live or not.
        self.places: dict[str, QueueName] = {}
        self.queues: dict[QueueName, _Queue] = {}

    def tasks(self, job_id: str) -> Collection[int]:
        """The pending task indices of a job with any pending (not to be changed)."""
        filed = self.indices[job_id]
        return (filed,) if isinstance(filed, int) else filed

    def filed(self, key: Key) -> bool:
        """Whether (job id, task index) is filed as pending."""
        filed = self.indices.get(key[0])
        if filed is None:
            return False
        return filed == key[1] if isinstance(filed, int) else key[1] in filed

    def keys(self) -> set[Key]:
        """Every filed (job id, task index): what `pending` held at the last sync."""
        return {(job_id, index) for job_id in self.indices for index in self.tasks(job_id)}

    def sync(self, pending: Mapping[Key, object], place_of: Callable[[str], Place]) -> None:
        """Files what changed in `pending` (ClusterState.pending) since the last call."""
        filed = self.filed
        added = [key for key in pending if not filed(key)]
        removed = [key for key in self.keys() if key not in pending]
        self._refile(added, removed, place_of)

    def apply(self, changes: Mapping[Key, bool], place_of: Callable[[str], Place]) -> None:
        """Files the changes to `pending` since the last call (ClusterState.pending_changes:
        True entered, False left): the same as `sync`, at the cost of the changes alone."""
        filed = self.filed
        added = [key for key, now in changes.items() if now and not filed(key)]
        removed = [key for key, now in changes.items() if not now and filed(key)]
        self._refile(added, removed, place_of)

    def _refile(self, added: Iterable[Key], removed: Iterable[Key],
                place_of: Callable[[str], Place]) -> None:
        thinned: set[QueueName] = set()
        indices = self.indices
        for job_id, index in removed:
            filed = indices[job_id]
            if not isinstance(filed, int):
                filed.discard(index)
                if filed:
                    continue
            del indices[job_id]
            self._count_need(job_id, -1)
            where = self.places[job_id]
            self.queues[where].live -= 1
            thinned.add(where)
        for job_id, index in added:
            now = indices.get(job_id)
            if now is None:
                indices[job_id] = index
                self._count_need(job_id, 1)
                self._file(job_id, place_of)
            elif isinstance(now, int):
                indices[job_id] = {now, index}
            else:
                now.add(index)
        for name in thinned:
            queue = self.queues[name]
            if len(queue.jobs) - queue.start > 2 * queue.live + 64:
                self._compact(queue)

    def _count_need(self, job_id: str, change: int) -> None:
        if not self.needs_known or self.need_of is None:
            return
        known = self.need_of(job_id)
        if known is None:  # gone from the fold: the least need is unknown from now on
            self.needs_known = False
            self.needs.clear()
            return
        need, gang = known
        self.gangs += change if gang else 0
        left = self.needs[need] + change
        if left > 0:
            self.needs[need] = left
        else:
            del self.needs[need]

    def least_need(self, leaving_out: Container[Amounts] = ()) -> Amounts | None:
        """No more than what one task of any job filed here needs, in each dimension (its
        least), the jobs of the needs `leaving_out` left out: placement's `stop_below`.
        None when unknown or nothing is left."""
        if not self.needs_known:
            return None
        needs = [n for n in self.needs if n not in leaving_out]
        if not needs:
            return None
        return Amounts(min(n.cpu for n in needs), min(n.mem for n in needs),
                       min(n.disk for n in needs), min(n.dev for n in needs))

    def needs_beyond(self, most: Amounts) -> frozenset[Amounts]:
        """The needs of the jobs filed that do not fit in `most` (empty when unknown)."""
        if not self.needs_known:
            return frozenset()
        return frozenset(n for n in self.needs if not n.fits_in(most))

    def gang_waits(self) -> bool:
        """Whether a gang may have a task filed (True when unknown)."""
        return not self.needs_known or self.gangs > 0

    def top_band(self) -> int | None:
        """The highest band (lowest rank) with a job filed, None if none is."""
        return min((band for (band, _, _), queue in self.queues.items() if queue.live),
                   default=None)

    def _file(self, job_id: str, place_of: Callable[[str], Place]) -> None:
        place = place_of(job_id)
        name = (place.band, place.user, place.need)
        queue = self.queues.get(name)
        if queue is None:
            queue = self.queues[name] = _Queue(name)
        queue.live += 1
        at = queue.position(place.seq, job_id)
        if job_id not in self.places:  # not listed yet (a requeued task's job may be)
            # At the end, unless it is a requeued task's.
            queue.seqs.insert(at, place.seq)
            queue.jobs.insert(at, job_id)
            self.places[job_id] = queue.name
        queue.start = min(queue.start, at)

    def _compact(self, queue: _Queue) -> None:
        seqs: list[int] = []
        jobs: list[str] = []
        for seq, job_id in zip(queue.seqs, queue.jobs, strict=True):
            if job_id in self.indices:
                seqs.append(seq)
                jobs.append(job_id)
            else:  # filed afresh (place_of) if a task of it waits again
                self.places.pop(job_id, None)
        queue.seqs, queue.jobs = seqs, jobs
        queue.start = 0

    def _live(self, queue: _Queue) -> Iterator[tuple[int, str]]:
        seqs, jobs, indices = queue.seqs, queue.jobs, self.indices
        i = queue.start
        while i < len(jobs) and jobs[i] not in indices:
            i += 1
        if i > 4096 and i > len(jobs) // 2:  # a consumed front: drop it
            for job_id in jobs[:i]:
                self.places.pop(job_id, None)
            del seqs[:i]
            del jobs[:i]
            i = 0
        queue.start = i
        for k in range(i, len(jobs)):
            if jobs[k] in indices:
                yield seqs[k], jobs[k]

    def ordered(self, used: Mapping[str, float], charge: Callable[[str], float | None],
                leaving_out: Container[Amounts] = ()) -> Iterator[str]:
        """Jobs with pending tasks in placement order. `used` is each user's recent use;
        `charge(job)` is what the job's pending tasks add to its user's key, or None to
        leave it out (all its pending tasks wait out a backoff): it then adds nothing.
        The jobs of the needs `leaving_out` are left out the same way, without a look at
        each: their queues are not read. Read it within one synchronous stretch: it must
        not outlive a `sync`.

        A user's queues in a band (one per need) share one key, the user's use plus the
        charges of the jobs taken so far: a queue's entry in the heap may hold a key that
        has grown since (another of the user's queues gave a job), and is put back with
        the key it has now when it comes first. Keys only grow, so the job that comes first
        with its key up to date is the next in order: the same order as one queue per user,
        with each user's jobs in submission order."""
        heap: list[tuple[int, float, int, str, Iterator[tuple[int, str]], tuple[int, str]]] = []
        key_of: dict[tuple[int, str], float] = {}
        for (band, user, need), queue in self.queues.items():
            if not queue.live or need in leaving_out:
                continue
            jobs = self._live(queue)
            first = next(jobs, None)
            if first is not None:
                key = key_of.setdefault((band, user), used.get(user, 0.0))
                heap.append((band, key, first[0], first[1], jobs, (band, user)))
        heapq.heapify(heap)
        while heap:
            band, key, seq, job_id, jobs, whose = heap[0]
            now = key_of[whose]
            if key < now:  # another of the user's queues gave a job since
                heapq.heapreplace(heap, (band, now, seq, job_id, jobs, whose))
                continue
            added = charge(job_id)
            if added is not None:
                yield job_id
                key_of[whose] = now = now + added
            following = next(jobs, None)
            if following is None:
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (band, now, following[0], following[1], jobs, whose))
