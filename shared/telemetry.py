"""OpenTelemetry set-up and W3C `traceparent` propagation through NATS headers.

Configured by the standard OTEL_* variables: spans are exported over OTLP/HTTP when
OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set, sampled as
OTEL_TRACES_SAMPLER says (the SDK's default: every trace; a job's spans share its submit's
trace, so `parentbased_traceidratio` samples whole jobs). With no exporter (and no
OTEL_TRACES_SAMPLER), nothing is recorded, and the services start no span per job (a
submit, a dispatch, an attempt): each passes on the trace context it was given, so a
client's `traceparent` still reaches the run command, but a span nobody reads costs
nothing. The scheduler's ticks still start theirs (one per tick, not per job).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Mapping

from opentelemetry import context, propagate, trace
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

_configured = False


def setup_tracing(service_name: str) -> None:
    global _configured
    if _configured:
        return
    _configured = True
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    exporting = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                     or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    # None: the SDK's own choice, from OTEL_TRACES_SAMPLER.
    sampler = None if exporting or os.environ.get("OTEL_TRACES_SAMPLER") else ALWAYS_OFF
    provider = TracerProvider(resource=resource, sampler=sampler)
    if exporting:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def recording() -> bool:
    """Whether a span started here may be recorded: false with berth's default (no exporter
    and no OTEL_TRACES_SAMPLER: ALWAYS_OFF) and with no provider set. When it is false, a
    message's trace context may be passed on as it came (`carrier_headers`) instead of
    through a span nobody reads: a consumer's spans then parent to the span that sent the
    message, one step up, in a trace nobody records either. The scheduler does so for
    each assignment it dispatches, where starting and ending a span, and reading and
    writing its context, were ~6 % of its CPU at full speed (docs/performance.md)."""
    provider = trace.get_tracer_provider()
    return isinstance(provider, TracerProvider) and provider.sampler is not ALWAYS_OFF


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


# What a service enters instead of starting a span when `recording()` is false: the block
# runs as it would inside a span that records nothing, and what it sends passes on the
# trace context it was given (`trace_fields`). Starting, entering and ending a span that
# nobody reads, and reading and writing its context, were a quarter of the submitter's CPU
# per job and a fifth of a simulated host's per attempt (docs/performance.md).
NO_SPAN: contextlib.nullcontext[trace.Span] = contextlib.nullcontext(trace.INVALID_SPAN)


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Adds the current span's `traceparent` (and `tracestate`) to NATS headers; nothing
    when nothing records, as then no span a message could name is ever read (the trace
    context a client sent is passed on explicitly: `trace_fields`)."""
    if recording():
        propagate.inject(headers)
    return headers


def trace_carrier(headers: Mapping[str, str]) -> str | dict[str, str]:
    """What a message's headers need kept to parent later spans: its traceparent string
    alone when that is all it propagates (kept per job for as long as it waits, so small),
    else the headers the configured propagators read (OTEL_PROPAGATORS)."""
    kept = trace_fields(headers)
    return kept["traceparent"] if kept.keys() == {"traceparent"} else kept


def trace_fields(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers of `headers` that the configured propagators read (OTEL_PROPAGATORS):
    its trace context, to send on unchanged."""
    fields = _fields_of(propagate.get_global_textmap())
    return {k: v for k, v in headers.items() if k in fields}


@functools.lru_cache(maxsize=4)
def _fields_of(textmap: TextMapPropagator) -> frozenset[str]:
    # A composite propagator builds its set anew each time it is asked (for every submit a
    # leader folds); a propagator's fields are fixed once it is made.
    return frozenset(textmap.fields)


def carrier_headers(carrier: str | dict[str, str] | None) -> dict[str, str] | None:
    """The headers `trace_carrier` kept, for `extract`."""
    return {"traceparent": carrier} if isinstance(carrier, str) else carrier


def extract(headers: dict[str, str] | None) -> context.Context:
    """The trace context a message carried, to parent the spans that handle it."""
    return propagate.extract(headers or {})
