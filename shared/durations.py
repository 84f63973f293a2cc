"""Durations as a job spec writes them: seconds as a number, or a string of a number and a
unit ("15s", "10m", "2h", "1d"), read to seconds in one place."""

from __future__ import annotations

import re

UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
# What the spec's JSON Schema says a duration string is; parse() accepts exactly these.
PATTERN = r"^[0-9]+(\.[0-9]+)?[smhd]?$"
_MATCH = re.compile(PATTERN)
EXAMPLES = "seconds, or a number with s, m, h or d: 15s, 10m, 2h"


def parse(value: float | str) -> float:
    """Seconds of `value`; ValueError (naming the value, not the field: the caller knows
    which field it read) if it is not a duration."""
    if isinstance(value, str):
        text = value.strip()
        if not _MATCH.match(text):
            raise ValueError(f"{value!r} is not a duration ({EXAMPLES})")
        unit = text[-1] if text[-1] in UNITS else "s"
        return float(text.rstrip("smhd")) * UNITS[unit]
    return float(value)


def show(seconds: float) -> str:
    """`seconds` in the largest unit that states it exactly: 15s, 10m, 2h, 1.5s."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"
