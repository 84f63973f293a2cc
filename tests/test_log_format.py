"""BERTH_LOG_FORMAT=json: a log line carries the trace and span ids of the span it was
logged in, so logs join traces."""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider

from berth.shared import config
from berth.shared.log_format import JsonFormatter


def test_a_line_logged_in_a_span_names_its_trace_and_span() -> None:
    tracer = TracerProvider().get_tracer("test")
    formatter = JsonFormatter("scheduler")
    record = logging.LogRecord("berth.scheduler", logging.INFO, __file__, 1, "placed %d", (3,),
                               None)
    with tracer.start_as_current_span("schedule.tick") as span:
        inside = json.loads(formatter.format(record))
    outside = json.loads(formatter.format(record))
    ctx = span.get_span_context()
    assert inside["trace_id"] == format(ctx.trace_id, "032x")
    assert inside["span_id"] == format(ctx.span_id, "016x")
    assert (inside["service"], inside["level"], inside["message"]) == ("scheduler", "INFO",
                                                                       "placed 3")
    assert "trace_id" not in outside


def test_an_unknown_log_format_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BERTH_LOG_FORMAT", "xml")
    with pytest.raises(SystemExit) as exc:
        config.log_format()
    assert str(exc.value) == "BERTH_LOG_FORMAT='xml' is not one of text, json"
    monkeypatch.setenv("BERTH_LOG_FORMAT", "JSON")
    assert config.log_format() == "json"
