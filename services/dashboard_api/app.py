"""The HTTP API (Litestar, msgspec structs) over the projection. OpenAPI at /schema."""

from __future__ import annotations

from importlib import resources
from typing import Annotated, NoReturn

from litestar import Litestar, MediaType, get, post
from litestar.exceptions import ClientException, NotFoundException
from litestar.openapi import OpenAPIConfig
from litestar.params import Parameter
from nats.js import JetStreamContext

from services.dashboard_api import views
from services.dashboard_api.projection import Projection
from shared import nats_io, subjects
from shared.lifecycle import JobView
from shared.messages import CancelRequest, encode
from shared.states import JOB_TERMINAL, JobState


def create_app(projection: Projection, js: JetStreamContext) -> Litestar:
    state = projection.state

    def find_job(job_id: str) -> JobView:
        job = state.jobs.get(job_id)
        if job is None:
            raise NotFoundException(f"no job {job_id!r}")
        return job

    @get("/healthz", sync_to_thread=False)
    def healthz() -> dict[str, object]:
        return {"status": "ok", "events_seq": state.last_seq}

    @get("/api/jobs", sync_to_thread=False)
    def list_jobs(
        state_filter: Annotated[
            str | None,
            Parameter(query="state", description="only jobs in this state, e.g. running"),
        ] = None,
        name_prefix: Annotated[str | None, Parameter(description="only names with this prefix")]
        = None,
    ) -> list[views.JobSummary]:
        if state_filter is not None and state_filter.upper() not in JobState.__members__:
            names = ", ".join(s.display for s in JobState)
            raise_bad_request(f"state: {state_filter!r} is not one of {names}")
        jobs = [
            views.job_summary(job)
            for job in state.jobs.values()
            if (state_filter is None or job.state.display == state_filter.lower())
            and (name_prefix is None or job.spec.name.startswith(name_prefix))
        ]
        jobs.sort(key=lambda j: j.submitted_at, reverse=True)
        return jobs

    @get("/api/jobs/{job_id:str}", sync_to_thread=False)
    def job_detail(job_id: str) -> views.JobDetail:
        return views.job_detail(find_job(job_id))

    @post("/api/jobs/{job_id:str}/cancel", status_code=202)
    async def cancel(job_id: str, data: views.CancelBody | None = None) -> views.CancelAccepted:
        """Cancels a job: its unfinished tasks are killed (SIGTERM, then SIGKILL after the
        grace period) and its child jobs cancelled. The same as publishing a cancel message
        to berth.submit.cancel; the outcome lands at /api/submits/{submit_seq}."""
        job = find_job(job_id)
        if job.state in JOB_TERMINAL:
            raise ClientException(f"job {job_id} already {job.state.display}", status_code=409)
        body = data or views.CancelBody()
        request = CancelRequest(job_id=job_id, reason=body.reason, user=body.user)
        ack = await js.publish(subjects.SUBMIT_CANCEL, encode(request),
                               stream=subjects.SUBMIT_STREAM)
        return views.CancelAccepted(job_id=job_id, submit_seq=int(ack.seq))

    @get("/api/workers", sync_to_thread=False)
    def list_workers() -> list[views.WorkerOut]:
        return [
            views.worker_out(w, projection.last_heartbeat.get(w.worker_id),
                             projection.worker_healthy(w.worker_id))
            for w in sorted(state.workers.values(), key=lambda w: w.worker_id)
        ]

    @get("/api/submits/{submit_seq:int}", sync_to_thread=False)
    def submit_outcome(submit_seq: int) -> views.SubmitOutcome:
        """What became of submit stream message N: its job, or the reason it was rejected."""
        if submit_seq in state.rejections:
            return views.SubmitOutcome(submit_seq, False, reason=state.rejections[submit_seq])
        job_id = state.job_by_submit.get(submit_seq)
        if job_id is not None:
            return views.SubmitOutcome(submit_seq, True, job_id=job_id, kind="job")
        job_id = state.cancel_by_submit.get(submit_seq)
        if job_id is not None:
            return views.SubmitOutcome(submit_seq, True, job_id=job_id, kind="cancel")
        raise NotFoundException(f"no outcome yet for submit {submit_seq}")

    @get("/api/jobs/{job_id:str}/tasks/{index:int}/logs", media_type=MediaType.TEXT)
    async def task_logs(
        job_id: str,
        index: int,
        attempt: Annotated[int | None, Parameter(description="default: the latest")] = None,
    ) -> str:
        job = find_job(job_id)
        if not 0 <= index < len(job.tasks):
            raise NotFoundException(f"job {job_id!r} has no task {index}")
        task = job.tasks[index]
        if attempt is None:
            current = task.current_attempt
            if current is None:
                return ""
            attempt = current.attempt_id
        elif task.attempt(attempt) is None:
            raise NotFoundException(f"task {job_id}/{index} has no attempt {attempt}")
        msgs = await nats_io.read_subject(
            js, subjects.LOGS_STREAM, subjects.attempt_logs(job_id, index, attempt)
        )
        return b"".join(m.data for m in msgs).decode(errors="replace")

    @get("/", media_type=MediaType.HTML, include_in_schema=False, sync_to_thread=False)
    def index() -> str:
        page = resources.files("services.dashboard_api").joinpath("static", "index.html")
        return page.read_text()

    return Litestar(
        route_handlers=[healthz, list_jobs, job_detail, cancel, list_workers, submit_outcome,
                        task_logs, index],
        openapi_config=OpenAPIConfig(title="berth dashboard API", version="0.1.0",
                                     path="/schema"),
    )


def raise_bad_request(detail: str) -> NoReturn:
    from litestar.exceptions import ValidationException

    raise ValidationException(detail)
