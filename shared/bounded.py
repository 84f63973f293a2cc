"""Size bounds for what berth publishes: NATS refuses a message over its max_payload (1 MiB
by default, `shared/servers.py`), so every message whose content grows with the cluster is
split into chunks under MAX_MESSAGE_BYTES, and every free text put into one is clipped.
Pure functions over plain data."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

# Half the server's default limit: room for headers and the message's other fields.
MAX_MESSAGE_BYTES = 512 * 1024
# A reason or error carried in an event (a pending reason, an unschedulable verdict).
MAX_TEXT_CHARS = 2000


def clip(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """`text`, or its first characters and a note of how many were cut."""
    if len(text) <= limit:
        return text
    note = f" ... ({len(text) - limit} more characters)"
    return text[:limit] + note


def chunks(items: Iterable[T], size: Callable[[T], int],
           max_bytes: int = MAX_MESSAGE_BYTES) -> list[list[T]]:
    """Splits `items`, in order, into consecutive lists whose sizes (by `size`) sum to at
    most `max_bytes`, none empty; an item larger than `max_bytes` alone is a chunk of its
    own (the caller keeps items small, e.g. with `clip`)."""
    out: list[list[T]] = []
    current: list[T] = []
    used = 0
    for item in items:
        n = size(item)
        if current and used + n > max_bytes:
            out.append(current)
            current, used = [], 0
        current.append(item)
        used += n
    if current:
        out.append(current)
    return out
