"""nats-py's protocol parser with a faster path for the frames a busy client reads: messages.

nats-py's `Parser.parse` tries a regular expression per protocol operation on each frame
(a headed message is tried against `MSG` first, then `HMSG`), copies every payload twice
(a bytearray slice, then `bytes`), and deletes each frame from the front of its buffer as
it goes. A catching-up dashboard spent 17% of its own time there (docs/performance.md).

This parser reads the buffer once per socket read: it finds each control line with `find`,
splits it on whitespace, slices header and payload from one immutable copy, and trims the
buffer once at the end. It hands the client exactly what nats-py's parser hands it (a
property test feeds both the same frames, split anywhere). `MSG`, `HMSG`, `PING`, `PONG`
and `+OK` are read here; anything else (`INFO`, `-ERR`, a malformed or unknown line) is
left to nats-py's own parser from that point on, so its errors and its handling of those
operations stay nats-py's.
"""

from __future__ import annotations

import re

from nats.protocol.parser import AWAITING_CONTROL_LINE, AWAITING_MSG_PAYLOAD, Parser

_CRLF = b"\r\n"
# nats-py's PING_RE, PONG_RE and OK_RE (`\APING\s*\r\n`, ...) as one pattern matched at a
# position: its greedy `\s*` also takes blank lines after the word (up to the last CRLF in
# the run of whitespace), so this does too.
_SIMPLE = re.compile(rb"(PING|PONG|\+OK)\s*\r\n")
_H = ord("H")
_M = ord("M")


class FastParser(Parser):
    """A drop-in for `nats.protocol.parser.Parser` (installed by `nats_io.Client`)."""

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf.extend(data)
        if self.state == AWAITING_MSG_PAYLOAD and len(buf) < self.needed + 2:
            return  # a large payload arriving over many reads is not copied on each
        nc = self.nc
        # The client's synchronous hand-over (`nats_io.Client._take_now`): most messages
        # need no coroutine of their own.
        take_now = getattr(nc, "_take_now", None)
        untaken = getattr(nc, "_process_untaken", None) if take_now else None
        process = untaken or nc._process_msg
        view = bytes(buf)  # one copy per read; every slice below is a single copy of it
        end = len(view)
        pos = 0  # the start of what is not yet handed over
        handed_back = False
        try:
            while pos < end:
                if self.state == AWAITING_MSG_PAYLOAD:
                    # A payload whose control line was read before it had all come (here,
                    # or by nats-py's parser after a fallback).
                    needed = self.needed
                    if end - pos < needed + 2:
                        return
                    header_size = self.header_needed
                    headers = view[pos:pos + header_size] if header_size else None
                    payload = view[pos + header_size:pos + needed]
                    args = self.msg_arg
                    self.state = AWAITING_CONTROL_LINE
                    self.header_needed = 0
                    pos += needed + 2
                    await nc._process_msg(args["sid"], args["subject"], args["reply"],
                                          payload, headers)
                    if self.buf is not buf:
                        return  # reset while the message was handled: the rest is void
                    continue
                line_end = view.find(_CRLF, pos)
                if line_end < 0:
                    return  # a control line split across reads
                op = view[pos]
                if op == _H and view.startswith(b"HMSG ", pos):
                    parts, sizes = view[pos + 5:line_end].split(), 2  # header, total
                elif op == _M and view.startswith(b"MSG ", pos):
                    parts, sizes = view[pos + 4:line_end].split(), 1  # total
                else:
                    parts, sizes = [], 0
                if sizes:
                    # subject, sid, [reply], then the sizes: all but subject and reply digits
                    named = len(parts) - sizes
                    if named not in (2, 3) or not (
                            parts[1].isdigit() and parts[-1].isdigit()
                            and (sizes == 1 or parts[-2].isdigit())):
                        handed_back = True
                        break
                    subject, sid_n = parts[0], int(parts[1])
                    reply = parts[2] if named == 3 else b""
                    size = int(parts[-1])
                    header_size = int(parts[-2]) if sizes == 2 else 0
                    start = line_end + 2
                    if end - start < size + 2:
                        pos = self._await_payload(start, subject, sid_n, reply, size, header_size)
                        return
                    # As nats-py: no headers (None) unless the frame gives them bytes.
                    headers = view[start:start + header_size] if header_size else None
                    payload = view[start + header_size:start + size]
                else:
                    simple = _SIMPLE.match(view, pos)
                    if simple is None:
                        handed_back = True
                        break
                    pos = simple.end()
                    word = simple.group(1)
                    if word == b"PING":
                        await nc._process_ping()
                    elif word == b"PONG":
                        await nc._process_pong()
                    if self.buf is not buf:
                        return
                    continue
                pos = start + size + 2
                if take_now is not None and take_now(sid_n, subject, reply, payload, headers):
                    continue
                await process(sid_n, subject, reply, payload, headers)
                if self.buf is not buf:
                    return
        finally:
            if pos and self.buf is buf:
                del buf[:pos]
        if handed_back:
            await super().parse()

    def _await_payload(self, start: int, subject: bytes, sid: int, reply: bytes, size: int,
                       header_size: int) -> int:
        """Keeps a message's control line read while its payload is still arriving, as
        nats-py's parser does; returns where the payload starts."""
        self.msg_arg = {"subject": subject, "sid": sid, "reply": reply}
        self.needed = size
        self.header_needed = header_size
        self.state = AWAITING_MSG_PAYLOAD
        return start
