"""BERTH_LOG_FORMAT=json: one JSON object per log line, with the current span's trace and
span ids, so a log line leads to its trace (and back)."""

from __future__ import annotations

import json
import logging

from opentelemetry import trace


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "service": self.service, "level": record.levelname, "logger": record.name,
            "message": record.getMessage(),
        }
        # Logged inside a span (a submit, a tick, a dispatch): the ids as W3C writes them.
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            line["trace_id"] = format(ctx.trace_id, "032x")
            line["span_id"] = format(ctx.span_id, "016x")
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)
