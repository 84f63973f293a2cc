"""OpenTelemetry set-up and W3C `traceparent` propagation through NATS headers.

Configured by the standard OTEL_* variables: spans are exported over OTLP/HTTP when
OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set; otherwise
spans are still created, so trace context still flows from service to service.
"""

from __future__ import annotations

import os

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

_configured = False


def setup_tracing(service_name: str) -> None:
    global _configured
    if _configured:
        return
    _configured = True
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    ):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Adds the current span's `traceparent` (and `tracestate`) to NATS headers."""
    propagate.inject(headers)
    return headers


def extract(headers: dict[str, str] | None) -> context.Context:
    """The trace context a message carried, to parent the spans that handle it."""
    return propagate.extract(headers or {})
