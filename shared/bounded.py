"""Size bounds for what berth publishes: NATS refuses a message over its max_payload (1 MiB
by default, `shared/servers.py`), so every message whose content grows with the cluster is
split into chunks under MAX_MESSAGE_BYTES, and every free text put into one is clipped.
Pure functions over plain data."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
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


def window(items: Sequence[str], start: str, size: Callable[[str], int],
           max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[list[str], str]:
    """The items of sorted `items` from `start` on whose sizes sum to at most `max_bytes`
    (at least one, if any is left), and where the next window starts: the first item left
    out, or "" once the end is reached. Windows from "" on, each starting where the last
    one said, cover every item exactly once and partition the key space: a window claims
    every item from its start up to (not including) where the next starts."""
    first = bisect.bisect_left(items, start)
    out: list[str] = []
    used = 0
    for item in items[first:]:
        n = size(item)
        if out and used + n > max_bytes:
            return out, item
        out.append(item)
        used += n
    return out, ""
