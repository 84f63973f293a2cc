"""When a NATS connection's reader waits before reading again: read coalescing under load.

Each message that arrives on its own costs a wake-up of the event loop (epoll, the socket
read, the transport, the parser): ~40 µs on a 2-core machine, most of a small message's cost.
At 10,000 hosts a scheduler and a dashboard each receive ~10,000 heartbeats a second, mostly
one per read. A reader that, under such load, stops reading for a couple of milliseconds
after a small read finds the messages that came meanwhile in one read: a NIC's interrupt
moderation, for the same reason (docs/performance.md).

Pacing starts only when the connection is busy, so an idle or lightly used one answers at
once: a window counts the messages the connection received; one of at least `busy_messages`
makes the next window paced, until a window passes without a read. A read that filled the
buffer (`small` bytes or more) is never followed by a pause: the reader is behind, and a
pause would only slow it.
"""

from __future__ import annotations

from dataclasses import dataclass

# A window of this many seconds...
WINDOW = 0.1
# ...with at least this many messages (1,000 a second) makes the next one paced: then a
# pause finds two messages or more waiting, on average. (10,000 hosts beating every 5 s
# send a scheduler 2,000 a second.)
BUSY_MESSAGES = 100
# The wait after a small read in a paced window: at 10,000 messages a second a read then
# carries ~20 of them. It delays a message by at most this much, only while the
# connection is busy.
PAUSE = 0.002
# A read of this many bytes or more is not small.
SMALL = 16_384


@dataclass(slots=True)
class ReadPacer:
    window: float = WINDOW
    busy_messages: int = BUSY_MESSAGES
    pause: float = PAUSE
    small: int = SMALL
    _window_start: float = 0.0
    _messages_at_start: int = 0
    _last_read: float = float("-inf")
    _paced: bool = False

    def pause_after(self, read_bytes: int, messages: int, now: float) -> float:
        """Seconds to wait before the next read, after a read of `read_bytes`; `messages`
        is the connection's count of messages received so far, `now` a monotonic time."""
        if now - self._last_read >= self.window:
            # A whole window without a read: the busy spell, if any, is over.
            self._paced = False
            self._window_start = now
            self._messages_at_start = messages
        elif now - self._window_start >= self.window:
            # A window stretched by slow reads: its count is spread over its length.
            windows = (now - self._window_start) / self.window
            self._paced = (messages - self._messages_at_start) / windows >= self.busy_messages
            self._window_start = now
            self._messages_at_start = messages
        self._last_read = now
        if self._paced and read_bytes < self.small:
            return self.pause
        return 0.0

    @property
    def paced(self) -> bool:
        return self._paced
