"""The submitter's view of which jobs a submit with `existing` or `dedup` collides with:
a fold of the events stream (so it survives restarts: it is the log), read only after
every earlier submit's outcome is in it (so concurrent submits, from any number of
submitters, are decided as if one by one in submit order). docs/lifecycle.md, "Existing
jobs and dedup", says why this and not a Redis key."""

from __future__ import annotations

import asyncio
import logging
import time

from nats.js import JetStreamContext

from berth.shared import job_policy, nats_io, service, subjects
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import JobsCompacted, JobSpec, JobSubmitted

log = logging.getLogger("berth.submitter")

# How long a submit waits for the earlier ones to be decided before it is put back (it is
# then redelivered, well inside the 30 s ack wait).
ORDER_WAIT = 20.0


class SubmitOrderTimeout(Exception):
    pass


class JobIndex:
    """Started on the first submit that needs it, so submitters that never see one fold
    nothing."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self.state = ClusterState()
        self.by_name: dict[tuple[str, str], list[str]] = {}
        self.by_spec: dict[tuple[str, str], list[str]] = {}
        self._follower: asyncio.Task[None] | None = None
        self._folded = asyncio.Event()

    async def _follow(self) -> None:
        # From where the fold stands: a follower that failed is started again from there.
        async for record in nats_io.follow_events(self.js, self.state.last_seq + 1):
            self.state.apply(record.seq, record.event)
            if isinstance(record.event, JobSubmitted):
                self._add(record.event)
            elif isinstance(record.event, JobsCompacted):
                self._forget(set(record.event.job_ids))
            self._folded.set()

    def _add(self, event: JobSubmitted) -> None:
        spec = event.spec
        ids = self.by_name.setdefault((spec.user, spec.name), [])
        if event.job_id not in ids:
            ids.append(event.job_id)
        ids = self.by_spec.setdefault((spec.user, job_policy.spec_hash(spec)), [])
        if event.job_id not in ids:
            ids.append(event.job_id)

    def _forget(self, job_ids: set[str]) -> None:
        """Compacted jobs (docs/retention.md): a later submit no longer collides with
        them, as with any job it cannot see."""
        for index in (self.by_name, self.by_spec):
            for key in [k for k, ids in index.items() if job_ids.intersection(ids)]:
                index[key] = [i for i in index[key] if i not in job_ids]
                if not index[key]:
                    del index[key]

    def _known(self, ids: list[str]) -> list[job_policy.Known]:
        return [job_policy.Known(i, job.state) for i in ids
                if (job := self.state.jobs.get(i)) is not None]

    async def verdict(self, spec: JobSpec, submit_seq: int) -> job_policy.Verdict:
        """`job_policy.resolve` over the jobs made by every submit before `submit_seq`.
        Raises SubmitOrderTimeout if an earlier submit is still undecided after ORDER_WAIT."""
        if self._follower is None or self._follower.done():
            if self._follower is not None and not self._follower.cancelled() and (
                    failed := self._follower.exception()) is not None:
                log.warning("following the events stream failed (%s); following again",
                            failed)
            self._follower = asyncio.create_task(self._follow())
        deadline = time.monotonic() + ORDER_WAIT
        await self._earlier_decided(submit_seq, deadline)
        # Every earlier outcome is stored now, so it is at or below the stream's end.
        target = await nats_io.last_event_seq(self.js)
        while self.state.last_seq < target:
            self._folded.clear()
            if time.monotonic() > deadline:
                raise SubmitOrderTimeout(f"the fold is at {self.state.last_seq}, not {target}")
            await service.wait_event(self._folded, 0.5)
        return job_policy.resolve(
            spec, self._known(self.by_name.get((spec.user, spec.name), [])),
            self._known(self.by_spec.get((spec.user, job_policy.spec_hash(spec)), [])))

    async def _earlier_decided(self, submit_seq: int, deadline: float) -> None:
        """Waits until the submitters' shared consumer has acknowledged every submit before
        this one: a submit is acknowledged only once its outcome is stored."""
        pause = 0.005
        while True:
            info = await self.js.consumer_info(subjects.SUBMIT_STREAM,
                                               subjects.SUBMITTER_DURABLE)
            floor = info.ack_floor.stream_seq if info.ack_floor else 0
            if (floor or 0) >= submit_seq - 1:
                return
            if time.monotonic() > deadline:
                raise SubmitOrderTimeout(f"submits up to {submit_seq - 1} are not all "
                                         f"decided (acknowledged up to {floor})")
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)

    async def close(self) -> None:
        if self._follower is not None:
            await service.cancel_and_wait([self._follower])
