"""One job's spans from the submitter, the scheduler and the worker share one trace. The
services export over OTLP/HTTP, configured only by the standard OTEL_* variables, to a
receiver in this test that keeps every span in memory."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from berth.client import submit_job
from berth.shared import servers
from berth.shared.messages import JobSpec, Resources
from berth.stack import Stack
from tests.conftest import wait_for_job, wait_until


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    links: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(items: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in items}


class InMemoryReceiver:
    """An OTLP/HTTP trace endpoint whose exporter-side is a list."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                for rs in request.resource_spans:
                    service = _attrs(rs.resource.attributes).get("service.name", "")
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            receiver.spans.append(Span(
                                service, s.name, s.trace_id.hex(), s.span_id.hex(),
                                s.parent_span_id.hex(), _attrs(s.attributes),
                                [(ln.trace_id.hex(), ln.span_id.hex(), _attrs(ln.attributes))
                                 for ln in s.links]))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.port = servers.free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def named(self, service: str, name: str, **attrs: Any) -> list[Span]:
        return [s for s in self.spans if s.service == service and s.name == name
                and all(s.attributes.get(k) == v for k, v in attrs.items())]


@pytest.fixture
def receiver() -> Iterator[InMemoryReceiver]:
    r = InMemoryReceiver()
    r.thread.start()
    yield r
    r.server.shutdown()


async def test_one_jobs_spans_from_three_services_share_one_trace(
        make_stack, nc, receiver: InMemoryReceiver) -> None:
    stack: Stack = make_stack(workers=1, extra_env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    })
    outcome = await submit_job(nc, JobSpec(name="traced", command=["true"],
                                           resources=Resources(cpu=0.5, memory_mb=64)))
    job_id = str(outcome.job_id)
    await wait_for_job(stack, job_id, {"succeeded"})

    def spans() -> tuple[Span, Span, Span] | None:
        submit = receiver.named("berth-submitter", "submit", **{"berth.job_id": job_id})
        dispatch = receiver.named("berth-scheduler", "dispatch", **{"berth.job_id": job_id})
        attempt = receiver.named("berth-worker", "attempt", **{"berth.attempt": f"{job_id}/0/0"})
        return (submit[0], dispatch[0], attempt[0]) if submit and dispatch and attempt else None

    submit, dispatch, attempt = await wait_until(spans, what="spans from all three services")
    assert submit.trace_id == dispatch.trace_id == attempt.trace_id
    assert dispatch.parent_id == submit.span_id  # scheduler's dispatch under the submit
    assert attempt.parent_id == dispatch.span_id  # the worker's attempt under the dispatch

    # The tick that placed it links to its submit; its reservation records the decision.
    ticks = [s for s in receiver.named("berth-scheduler", "schedule.tick")
             if any(link[1] == submit.span_id for link in s.links)]
    assert ticks, "no tick span links to the submit"
    tick = ticks[0]
    link = next(ln for ln in tick.links if ln[1] == submit.span_id)
    assert link[0] == submit.trace_id and link[2]["berth.job_id"] == job_id
    reserve = next(s for s in receiver.named("berth-scheduler", "reserve")
                   if s.parent_id == tick.span_id)
    assert reserve.attributes["berth.outcome"] == "ok"
    assert reserve.attributes["berth.hosts"] == ["local-0"]
    assert reserve.attributes["berth.epoch"] >= 1


def test_what_a_waiting_job_keeps_of_its_trace_is_enough_to_parent_its_spans() -> None:
    from opentelemetry import trace

    from berth.shared import telemetry

    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    alone = telemetry.trace_carrier({"traceparent": parent, "Nats-Msg-Id": "submit:7"})
    assert alone == parent  # a string, not the message's headers
    more = {"traceparent": parent, "tracestate": "congo=t61rcWkgMzE", "Nats-Msg-Id": "x"}
    kept = telemetry.trace_carrier(more)
    assert kept == {"traceparent": parent, "tracestate": "congo=t61rcWkgMzE"}
    for carrier in (alone, kept):
        span = trace.get_current_span(telemetry.extract(telemetry.carrier_headers(carrier)))
        assert f"{span.get_span_context().trace_id:032x}" == parent.split("-")[1]
    assert telemetry.carrier_headers(None) is None


def test_a_message_sent_without_a_span_passes_on_the_trace_context_it_was_given() -> None:
    from berth.shared import nats_io

    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    given = {"traceparent": parent, "tracestate": "congo=t61rcWkgMzE", "Nats-Msg-Id": "x",
             "Other": "y"}
    assert nats_io.message_headers("submit-outcome:7", passed_on=given) == {
        "Nats-Msg-Id": "submit-outcome:7", "traceparent": parent,
        "tracestate": "congo=t61rcWkgMzE"}
    # Given none (a client that sent no trace): none is made up.
    assert nats_io.message_headers("submit-outcome:8", passed_on={}) == {
        "Nats-Msg-Id": "submit-outcome:8"}


def test_spans_are_recorded_only_with_a_provider_that_samples(monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

    from berth.shared import telemetry

    for provider, recorded in ((trace.NoOpTracerProvider(), False),
                               (TracerProvider(sampler=ALWAYS_OFF), False),
                               (TracerProvider(sampler=ALWAYS_ON), True),
                               (TracerProvider(), True)):
        monkeypatch.setattr(trace, "get_tracer_provider", lambda p=provider: p)
        assert telemetry.recording() is recorded, provider


async def test_with_no_exporter_a_run_command_still_carries_its_submits_trace(
        make_stack, nc) -> None:
    """Nothing is recorded (berth's default), so no service starts a span per job: the
    submitter's outcome and the scheduler's run command pass the trace context on as the
    submit brought it, and a trace the client records still reaches the host."""
    import uuid

    from berth.client import wait_for_outcome
    from berth.shared import subjects
    from berth.shared.messages import encode

    stack: Stack = make_stack(workers=1)
    commands = await nc.subscribe(subjects.worker_commands("local-0"))
    trace_id = uuid.uuid4().hex
    traceparent = f"00-{trace_id}-{uuid.uuid4().hex[:16]}-00"
    spec = JobSpec(name="traced", command=["true"], resources=Resources(cpu=0.5, memory_mb=64))
    ack = await nc.jetstream().publish(
        subjects.SUBMIT_JOB, encode(spec), stream=subjects.SUBMIT_STREAM,
        headers={"Nats-Msg-Id": uuid.uuid4().hex, "traceparent": traceparent})
    outcome = await wait_for_outcome(nc, int(ack.seq), None, 30)
    job_id = str(outcome.job_id)
    stored = await nc.jetstream().get_last_msg(subjects.EVENTS_STREAM,
                                               subjects.submit_outcome(None, int(ack.seq)))
    assert (stored.headers or {}).get("traceparent") == traceparent
    await wait_for_job(stack, job_id, {"succeeded"})
    while True:
        msg = await commands.next_msg(timeout=10)
        if f'"{job_id}"'.encode() in msg.data:
            break
    assert (msg.headers or {}).get("traceparent", "").split("-")[1] == trace_id
    # A client that sent no trace context: none is made up on the way.
    ack = await nc.jetstream().publish(subjects.SUBMIT_JOB, encode(spec),
                                       stream=subjects.SUBMIT_STREAM)
    untraced = str((await wait_for_outcome(nc, int(ack.seq), None, 30)).job_id)
    stored = await nc.jetstream().get_last_msg(subjects.EVENTS_STREAM,
                                               subjects.submit_outcome(None, int(ack.seq)))
    assert "traceparent" not in (stored.headers or {})
    await wait_for_job(stack, untraced, {"succeeded"})
    while True:
        msg = await commands.next_msg(timeout=10)
        if f'"{untraced}"'.encode() in msg.data:
            break
    assert "traceparent" not in (msg.headers or {})
