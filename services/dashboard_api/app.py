"""The HTTP API (Litestar, msgspec structs) over the projection, and the web pages.
OpenAPI at /schema (JSON at /schema/openapi.json). Reads are open unless closed (see
auth.closed_reads_reason); actions need a bearer token whose role allows them (auth.py); a
spec's env values reach only those allowed to see them (redact.py)."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Annotated

import msgspec
from litestar import Litestar, MediaType, Request, Router, get, post
from litestar.exceptions import (
    ClientException,
    NotFoundException,
    PermissionDeniedException,
    ValidationException,
)
from litestar.openapi import OpenAPIConfig
from litestar.params import FromPath, JSONBody, QueryParameter
from litestar.response import Response, Stream
from litestar.static_files import create_static_files_router
from nats.js import JetStreamContext
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from berth.services.dashboard_api import auth, live, redact, timeline, views
from berth.services.dashboard_api import metrics as dashboard_metrics
from berth.services.dashboard_api.projection import Projection
from berth.shared import job_policy, nats_io, queue_order, subjects
from berth.shared import metrics as shared_metrics
from berth.shared.api_tokens import Role
from berth.shared.job_ids import submit_seq_of
from berth.shared.lifecycle import JobView, TaskView
from berth.shared.messages import CancelRequest, JobSpec, encode
from berth.shared.states import JOB_TERMINAL, job_state_names

STATIC = Path(__file__).parent / "static"
MAX_PAGE = 1000
# How long a read of a job (or a submit's outcome) not yet folded waits for the fold to
# reach what the stream holds now: the client may have just been told of it.
JUST_DECIDED_WAIT = 1.0


def create_app(projection: Projection, js: JetStreamContext, tokens: auth.Tokens,
               closed_reads: bool = False, metrics_refresh: shared_metrics.Refresh | None = None
               ) -> Litestar:
    def find_job(job_id: str) -> JobView:
        job = projection.state.jobs.get(job_id)
        if job is None:
            compacted = projection.state.compacted_jobs
            raise NotFoundException(
                f"no job {job_id!r}" + (f" (or it was compacted out of the events stream "
                                        f"after its retention period, as {compacted} finished "
                                        f"jobs have been: docs/retention.md)"
                                        if compacted else ""))
        return job

    async def found_job(job_id: str) -> JobView:
        """`find_job`, once what the stream holds now is folded, if the job is not yet
        (bounded by JUST_DECIDED_WAIT): a client that was just given a job id finds it."""
        if job_id not in projection.state.jobs and submit_seq_of(job_id) is not None:
            await projection.fold_to_head(JUST_DECIDED_WAIT)
        return find_job(job_id)

    async def found_task(job_id: str, index: int) -> tuple[JobView, TaskView]:
        await found_job(job_id)
        return find_task(job_id, index)

    def find_task(job_id: str, index: int) -> tuple[JobView, TaskView]:
        job = find_job(job_id)
        if not 0 <= index < len(job.tasks):
            raise NotFoundException(f"job {job_id!r} has no task {index} "
                                    f"(it has {len(job.tasks)})")
        return job, job.tasks[index]

    def outcome_of(submit_seq: int) -> views.SubmitOutcome | None:
        """The submitter's verdict on submit N, once folded."""
        s = projection.state
        if submit_seq in s.rejections:
            return views.SubmitOutcome(submit_seq, False, reason=s.rejections[submit_seq])
        job_id = s.job_by_submit.get(submit_seq)
        if job_id is not None:
            note = job_policy.recreated_words(s.jobs[job_id].replaced)
            return views.SubmitOutcome(submit_seq, True, job_id=job_id, kind="job", note=note)
        if submit_seq in s.same_by_submit:
            job_id, how = s.same_by_submit[submit_seq]
            return views.SubmitOutcome(submit_seq, True, job_id=job_id, kind=how,
                                       note=job_policy.in_words(how, job_id))
        for schedule in s.schedules.values():
            if schedule.submit_seq == submit_seq:
                return views.SubmitOutcome(submit_seq, True, job_id=schedule.schedule_id,
                                           kind="schedule")
        job_id = s.cancel_by_submit.get(submit_seq)
        if job_id is not None:
            return views.SubmitOutcome(submit_seq, True, job_id=job_id, kind="cancel")
        return None

    # --- jobs -----------------------------------------------------------------------------

    @get("/jobs", sync_to_thread=False)
    def list_jobs(
        state_filter: Annotated[str | None, QueryParameter(
            name="state", description="only jobs in this state, e.g. running")] = None,
        name_prefix: Annotated[str | None, QueryParameter(
            description="only jobs whose name starts with this")] = None,
        parent: Annotated[str | None, QueryParameter(
            description="only children of this job")] = None,
        user: Annotated[str | None, QueryParameter(description="only jobs of this user")] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=MAX_PAGE,
                                        description="jobs per page")] = 100,
        cursor: Annotated[str | None, QueryParameter(
            description="next_cursor of the previous page")] = None,
    ) -> views.JobPage:
        """Jobs, newest first, one page at a time."""
        wanted_state: str | None = None
        if state_filter is not None:
            names = job_state_names()
            if state_filter.lower() not in names:
                raise ValidationException(
                    f"state: {state_filter!r} is not one of {', '.join(names)}")
            wanted_state = state_filter.lower()
        before: int | None = None
        if cursor is not None:
            if not cursor.isdigit():
                raise ValidationException(f"cursor: {cursor!r} is not a cursor from this API")
            before = int(cursor)

        def wanted(job: JobView) -> bool:
            return ((wanted_state is None or job.state.display == wanted_state)
                    and (name_prefix is None or job.spec.name.startswith(name_prefix))
                    and (user is None or job.spec.user == user)
                    and (before is None or job.submit_seq < before))

        if parent is not None:
            candidates = sorted((projection.state.jobs[c] for c in find_job(parent).children),
                                key=lambda j: j.submit_seq, reverse=True)
        else:
            order = projection.job_order
            candidates = [order[i] for i in projection.jobs_before(before)]
        page: list[JobView] = []
        more = False
        for job in filter(wanted, candidates):
            if len(page) == limit:
                more = True
                break
            page.append(job)
        return views.JobPage(
            jobs=[views.job_summary(j) for j in page],
            next_cursor=str(page[-1].submit_seq) if more else None)

    @get("/states", sync_to_thread=False)
    def states() -> views.StateNames:
        """The state names: `job` are the values the `state` filter of /api/jobs accepts."""
        return views.state_names()

    @get("/jobs/{job_id:str}")
    async def job_detail(job_id: FromPath[str], request: Request) -> views.JobDetail:  # type: ignore[type-arg]
        """A job with its task-state counts, its tasks and each task's attempt history. The
        spec's env values show only to an admin or the job's own user."""
        job = await found_job(job_id)
        return views.job_detail(job, redact.spec_for(tokens.caller(request), job.spec))

    @get("/jobs/{job_id:str}/queue")
    async def job_queue(job_id: FromPath[str]) -> views.QueuePlace | None:
        """Where the job stands in its priority band's queue of jobs with pending tasks
        (placed in that order: band, then users by fair share, each user's jobs by
        submission); null when none of its tasks is pending."""
        job = await found_job(job_id)
        state, fair = projection.state, projection.fair_share
        queue = queue_order.order(queue_order.pending_jobs(state.pending, state.jobs, fair),
                                  queue_order.costs(state.recent_use, time.time(), fair))
        place = queue_order.band_place(job, queue)
        return None if place is None else views.QueuePlace(job.spec.priority.value, *place)

    @get("/jobs/{job_id:str}/tasks/{index:int}")
    async def task_detail(job_id: FromPath[str], index: FromPath[int]) -> views.TaskDetail:
        """One task: state, current attempt, attempt history, pending_reason, exit, error."""
        job, task = await found_task(job_id, index)
        return views.task_detail(job, task)

    @post("/jobs", guards=[auth.action_guard(tokens, "submitting")], status_code=202)
    async def submit(
        data: JSONBody[JobSpec],
        request: Request,  # type: ignore[type-arg]
        wait: Annotated[float, QueryParameter(
            ge=0, le=60, description="seconds to wait for the submitter's verdict")] = 10.0,
    ) -> Response[views.SubmitAccepted]:
        """Submits a job: the same JSON as a message on berth.submit.job (`berth schema`).
        201 with the job id once accepted within `wait`; 400 naming the problem if the
        submitter rejects it; 202 with the submit sequence if the verdict is still to come.
        An Idempotency-Key header makes a retried request the same submission. The job's
        `user` is the token's identity; an admin token may name any user."""
        who = auth.require(tokens, request, "submitting", (Role.SUBMIT, Role.ADMIN))
        user = _acting_user(who, data.user)
        if user != data.user:
            data = msgspec.structs.replace(data, user=user)
        # An admin submits on the bare subject (its spec's user taken as given), anyone
        # else on its own, where the submitter holds it to its identity.
        subject = subjects.submit_job(None if who.role is Role.ADMIN else who.name)
        msg_id = request.headers.get("idempotency-key") or uuid.uuid4().hex
        ack = await js.publish(subject, encode(data),
                               headers={"Nats-Msg-Id": msg_id}, stream=subjects.SUBMIT_STREAM)
        seq = int(ack.seq)
        outcome = f"/api/submits/{seq}"
        deadline = time.monotonic() + wait
        while True:
            verdict = outcome_of(seq)
            if verdict is not None and not verdict.accepted:
                raise ClientException(verdict.reason, extra={"submit_seq": seq})
            if verdict is not None:
                return Response(views.SubmitAccepted(seq, verdict.job_id, outcome),
                                status_code=201)
            left = deadline - time.monotonic()
            if left <= 0:
                return Response(views.SubmitAccepted(seq, None, outcome), status_code=202)
            await projection.wait_for_change(left)

    @post("/jobs/{job_id:str}/cancel", guards=[auth.action_guard(tokens, "cancelling")],
          status_code=202)
    async def cancel(job_id: FromPath[str], request: Request,  # type: ignore[type-arg]
                     data: JSONBody[views.CancelBody | None] = None) -> views.CancelAccepted:
        """Cancels a job: its unfinished tasks are killed (SIGTERM, then SIGKILL after the
        grace period) and its child jobs cancelled. The same as publishing a cancel message
        to berth.submit.cancel; the outcome lands at /api/submits/{submit_seq}. A submit
        token may cancel only its own user's jobs; an admin token any job."""
        who = auth.require(tokens, request, "cancelling", (Role.SUBMIT, Role.ADMIN))
        job = await found_job(job_id)
        if not who.owns(job.spec.user):
            raise PermissionDeniedException(
                f"job {job_id} belongs to user {job.spec.user!r}; token {who.name!r} "
                f"(role {who.role.value}) may cancel only its own jobs")
        body = data or views.CancelBody()
        user = _acting_user(who, body.user)
        if job.state in JOB_TERMINAL:
            raise ClientException(f"job {job_id} already {job.state.display}", status_code=409)
        cancel_request = CancelRequest(job_id=job_id, reason=body.reason, user=user)
        subject = subjects.submit_cancel(None if who.role is Role.ADMIN else who.name)
        ack = await js.publish(subject, encode(cancel_request), stream=subjects.SUBMIT_STREAM)
        return views.CancelAccepted(job_id=job_id, submit_seq=int(ack.seq))

    @get("/jobs/{job_id:str}/tasks/{index:int}/logs", media_type=MediaType.TEXT)
    async def task_logs(
        job_id: FromPath[str],
        index: FromPath[int],
        attempt: Annotated[int | None, QueryParameter(description="default: the latest")] = None,
        tail: Annotated[int | None, QueryParameter(ge=0, description="only the last N lines")]
        = None,
        follow: Annotated[bool, QueryParameter(
            description="keep streaming until the attempt has exited")] = False,
        stream: Annotated[str | None, QueryParameter(
            description="only this output: stdout, stderr or build")] = None,
    ) -> Response[str] | Stream:
        """A task attempt's stdout and stderr (and its build's output), interleaved as
        written, or only the one `stream` names."""
        if stream is not None and stream not in subjects.LOG_STREAMS:
            raise ValidationException(
                f"stream: {stream!r} is not one of {', '.join(subjects.LOG_STREAMS)}")
        _, task = await found_task(job_id, index)
        if attempt is None:
            shown = task.current_attempt
            if shown is None:
                return Response("", media_type=MediaType.TEXT)
            attempt = shown.attempt_id
        elif (shown := task.attempt(attempt)) is None:
            raise NotFoundException(f"task {job_id}/{index} has no attempt {attempt}")
        subject = subjects.attempt_logs(shown.worker_id, job_id, index, attempt)
        msgs = await nats_io.read_subject(js, subjects.LOGS_STREAM, subject)
        text = b"".join(m.data for m in msgs
                        if live.of_stream(m, stream)).decode(errors="replace")
        if tail is not None:
            text = live.tail_lines(text, tail)
        if not follow:
            return Response(text, media_type=MediaType.TEXT)
        attempt_id = attempt
        # Followed from just after what was read above, so nothing is read twice.
        after = msgs[-1].metadata.sequence.stream if msgs else None

        def exited() -> bool:
            view = task.attempt(attempt_id)
            return view is None or view.exited

        async def body() -> AsyncGenerator[bytes]:
            yield text.encode()
            async for chunk in live.follow_log(js, subject, exited, after, stream=stream):
                yield chunk

        return Stream(body(), media_type=MediaType.TEXT)

    # --- the host timeline -------------------------------------------------------------------

    @get("/timeline", sync_to_thread=False)
    def host_timeline(
        since: Annotated[float | None, QueryParameter(
            description="window start (Unix seconds); default: an hour before `until`")]
        = None,
        until: Annotated[float | None, QueryParameter(
            description="window end (Unix seconds); default: now")] = None,
        hosts: Annotated[str | None, QueryParameter(
            description="only these worker ids, comma-separated")] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=timeline.MAX_HOSTS,
                                        description="hosts per page")] = 100,
        cursor: Annotated[str | None, QueryParameter(
            description="next_cursor of the previous page")] = None,
    ) -> timeline.Timeline:
        """Per host (worker), the attempts that held it within the window: job, task,
        attempt, gang group, when assigned, started and gone (null: still holding), state;
        and `overlaps`, attempts of two gangs holding it at once (never any). Plus the
        cluster's tasks by state and busy hosts over the window. Hosts by worker id, one
        page at a time."""
        for name, value in (("since", since), ("until", until)):
            if value is not None and not math.isfinite(value):
                raise ValidationException(f"{name}: {value} is not a time")
        end = time.time() if until is None else until
        start = end - 3600.0 if since is None else since
        if start >= end:
            raise ValidationException(f"since: {start} is not before until ({end})")
        wanted = None
        if hosts is not None:
            wanted = [h for h in hosts.split(",") if h]
            if len(wanted) > timeline.MAX_HOSTS:
                raise ValidationException(
                    f"hosts: {len(wanted)} named, at most {timeline.MAX_HOSTS}")
        rows, total, next_cursor = timeline.host_page(
            projection.state, projection.host_attempts, start, end, wanted, limit, cursor)
        return timeline.Timeline(
            since=start, until=end, hosts=rows, total_hosts=total, next_cursor=next_cursor,
            truncated=any(r.truncated for r in rows),
            cluster=timeline.cluster_series(projection.cluster_samples, start, end,
                                            projection.cluster_now()))

    # --- workers, submits, live -------------------------------------------------------------

    def worker_out(worker_id: str) -> views.WorkerOut:
        w = projection.state.workers[worker_id]
        return views.worker_out(w, projection.last_heartbeat.get(worker_id),
                                projection.worker_healthy(worker_id),
                                projection.device_stats.get(worker_id, ()))

    @get("/workers", sync_to_thread=False)
    def list_workers() -> list[views.WorkerOut]:
        """Every worker: resources, free capacity, attributes, heartbeat, running attempts."""
        return [worker_out(w) for w in sorted(projection.state.workers)]

    @get("/workers/{worker_id:str}", sync_to_thread=False)
    def worker_detail(worker_id: FromPath[str]) -> views.WorkerOut:
        if worker_id not in projection.state.workers:
            raise NotFoundException(f"no worker {worker_id!r}")
        return worker_out(worker_id)

    @get("/schedules", sync_to_thread=False)
    def list_schedules() -> list[views.ScheduleOut]:
        """Every schedule, oldest first, with its next run (none once cancelled)."""
        now = time.time()
        return [views.schedule_out(s, now) for s in projection.state.schedules.values()]
    @get("/limits", sync_to_thread=False)
    def limits() -> views.LimitsOut:
        """Quotas and token limits, and what live attempts hold of them."""
        return views.limits_out(projection.state.limits, projection.state.usage)

    @get("/submits/{submit_seq:int}")
    async def submit_outcome(submit_seq: FromPath[int]) -> views.SubmitOutcome:
        """What became of submit stream message N: its job, or the reason it was rejected."""
        verdict = outcome_of(submit_seq)
        if verdict is None:
            await projection.fold_to_head(JUST_DECIDED_WAIT)
            verdict = outcome_of(submit_seq)
        if verdict is None:
            raise NotFoundException(f"no outcome yet for submit {submit_seq}")
        return verdict

    @get("/events", media_type="text/event-stream")
    async def events(
        request: Request,  # type: ignore[type-arg]
        after: Annotated[int | None, QueryParameter(
            ge=0, description="start after this stream sequence (Last-Event-ID wins); "
                              "default: only events from now on")] = None,
    ) -> Stream:
        """Server-Sent Events: each event of the events stream as JSON, with its stream
        sequence as the SSE id. Reconnecting with Last-Event-ID resumes without a gap."""
        header = request.headers.get("last-event-id")
        if header is not None:
            if not header.strip().isdigit():
                raise ValidationException(f"Last-Event-ID: {header!r} is not a sequence")
            after = int(header)
        start = projection.state.last_seq if after is None else after
        who = tokens.caller(request)
        return Stream(live.sse_events(projection, start,
                                      lambda data: redact.event_for(who, data)),
                      media_type="text/event-stream",
                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    api = Router(
        path="/api",
        guards=[auth.read_guard(tokens, closed_reads)],
        route_handlers=[list_jobs, states, job_detail, job_queue, task_detail, submit, cancel,
                        task_logs, host_timeline, list_workers, worker_detail, submit_outcome,
                        list_schedules, events, limits],
    )

    # --- open to all ------------------------------------------------------------------------

    @get("/healthz", sync_to_thread=False)
    def healthz() -> Response[dict[str, object]]:
        """503 until the projection has folded the log as it stood at start: until then
        its answers would show a past state (readiness probes and `berth health` wait)."""
        caught_up = projection.caught_up.is_set()
        return Response({"status": "ok" if caught_up else "catching_up",
                         "events_seq": projection.state.last_seq, "caught_up": caught_up,
                         "refused_events": projection.state.refused_events,
                         "last_refused_seq": projection.state.last_refused_seq},
                        status_code=200 if caught_up else 503)

    @get("/metrics", media_type=CONTENT_TYPE_LATEST, guards=[auth.read_guard(tokens, closed_reads)],
         include_in_schema=False)
    async def prometheus() -> Response[bytes]:
        """Prometheus metrics (docs/metrics.md), under the same read rule as /api."""
        await shared_metrics.refresh_all([metrics_refresh] if metrics_refresh else [])
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @get(["/", "/jobs/{job_id:str}", "/workers", "/timeline", "/schedules"],
         media_type=MediaType.HTML,
         include_in_schema=False, sync_to_thread=False)
    def page() -> str:
        # The page reads a job's id from its own URL: the server has no use for it.
        return (STATIC / "index.html").read_text()

    return Litestar(
        route_handlers=[api, healthz, prometheus, page,
                        create_static_files_router(path="/static", directories=[STATIC],
                                                   include_in_schema=False)],
        middleware=[dashboard_metrics.middleware()],
        openapi_config=OpenAPIConfig(title="berth dashboard API", version="0.2.0",
                                     path="/schema"),
    )


def _acting_user(who: auth.Caller, asked: str) -> str:
    """The user a request acts as: a submit token only as its own identity, an admin as the
    user it names (itself if none)."""
    if who.role is Role.ADMIN:
        return asked or who.name
    if asked and asked != who.name:
        raise PermissionDeniedException(
            f"user: {asked!r} is not this token's identity {who.name!r}; a {who.role.value} "
            "token acts only as itself (leave user empty)")
    return who.name
