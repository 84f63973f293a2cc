"""`nats_parser.FastParser` hands the client exactly what nats-py's parser hands it."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from nats.errors import ProtocolError
from nats.protocol.parser import Parser

from berth.shared import nats_io
from berth.shared.nats_parser import FastParser


class Recorder:
    """Stands in for the client: records each call the parser makes."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.parser: Parser | None = None
        self.reset_on_msg = -1

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes,
                           headers: bytes | None) -> None:
        self.calls.append(("msg", sid, subject, reply, data, headers))
        for value in (subject, reply, data):
            assert type(value) is bytes
        if len(self.calls) == self.reset_on_msg and self.parser is not None:
            self.parser.reset()  # what a reconnect does while a message is handled

    async def _process_ping(self) -> None:
        self.calls.append(("ping",))

    async def _process_pong(self) -> None:
        self.calls.append(("pong",))

    async def _process_info(self, info: dict[str, Any]) -> None:
        self.calls.append(("info", info))

    async def _process_err(self, message: str) -> None:
        self.calls.append(("err", message))


token = st.text("abcxyz.$_>*-019", min_size=1, max_size=12).map(str.encode)
body = st.binary(max_size=40)


@st.composite
def frame(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["msg", "msg", "hmsg", "hmsg", "ping", "pong", "ok", "info",
                                 "err"]))
    subject = draw(token)
    sid = draw(st.integers(0, 10_000))
    reply = draw(st.one_of(st.just(b""), token))
    space = b" " + draw(st.sampled_from([b"", b" ", b"\t"]))
    reply_part = reply + space if reply else b""
    if kind == "msg":
        data = draw(body)
        return (b"MSG" + space + subject + space + b"%d" % sid + space + reply_part
                + b"%d\r\n" % len(data) + data + b"\r\n")
    if kind == "hmsg":
        headers = b"NATS/1.0\r\n" + draw(body) + b"\r\n\r\n"
        data = draw(body)
        return (b"HMSG" + space + subject + space + b"%d" % sid + space + reply_part
                + b"%d %d\r\n" % (len(headers), len(headers) + len(data)) + headers + data
                + b"\r\n")
    if kind == "info":
        return b'INFO {"server_id":"%s"}\r\n' % subject
    if kind == "err":
        return b"-ERR 'Slow Consumer'\r\n"
    return {"ping": b"PING", "pong": b"PONG", "ok": b"+OK"}[kind] + space.rstrip(b" ") + b"\r\n"


def run(parser_type: type[Parser], chunks: list[bytes], reset_on_msg: int = -1
        ) -> tuple[list[tuple[Any, ...]], bytes, str]:
    recorder = Recorder()
    recorder.reset_on_msg = reset_on_msg
    parser = parser_type(recorder)
    recorder.parser = parser

    async def feed() -> str:
        try:
            for chunk in chunks:
                await parser.parse(chunk)
        except ProtocolError as exc:
            return str(exc)
        return ""

    error = asyncio.run(feed())
    return recorder.calls, bytes(parser.buf), error


def split(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(stream) + 1) for c in cuts})
    bounds = [0, *points, len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=300, deadline=None)
@given(st.lists(frame(), max_size=12), st.lists(st.integers(0, 10_000), max_size=8))
def test_same_calls_as_nats_py_for_any_split(frames: list[bytes], cuts: list[int]) -> None:
    chunks = split(b"".join(frames), cuts)
    assert run(FastParser, chunks) == run(Parser, chunks)


@settings(max_examples=100, deadline=None)
@given(st.lists(frame(), min_size=1, max_size=8), st.binary(min_size=1, max_size=12),
       st.lists(st.integers(0, 1000), max_size=4))
# nats-py's `PING\s*\r\n` takes a blank line after PING with it (found by this test in CI).
@example(frames=[b"PING\r\n"], junk=b"\t", cuts=[])
@example(frames=[b"PONG\r\n", b"MSG a 1 2\r\nhi\r\n"], junk=b" \r\n ", cuts=[7])
def test_same_outcome_as_nats_py_for_a_malformed_line(frames: list[bytes], junk: bytes,
                                                       cuts: list[int]) -> None:
    # Whatever nats-py makes of a bad line (an error, or bytes it waits on), so does this.
    stream = b"".join(frames[:1]) + junk + b"\r\n" + b"".join(frames[1:])
    chunks = split(stream, cuts)
    assert run(FastParser, chunks) == run(Parser, chunks)


@pytest.mark.parametrize("line", [b"MSG a 1 -5\r\n", b"MSG a x 5\r\n", b"HMSG a 1 2 +9\r\n",
                                  b"MSG a 1 b c 5\r\n", b"HMSG a 1\r\n", b"NOPE\r\n"])
def test_a_malformed_control_line_is_nats_pys_protocol_error(line: bytes) -> None:
    calls, _, error = run(FastParser, [b"PING\r\n" + line + b"MSG a 1 0\r\n\r\n"])
    assert error == "nats: protocol error"
    assert calls == [("ping",)]
    assert run(Parser, [b"PING\r\n" + line + b"MSG a 1 0\r\n\r\n"])[2] == error


@pytest.mark.parametrize("frame", [b"HMSG a 1 0 1\r\nx\r\n", b"HMSG a 1 r 0 0\r\n\r\n",
                                   b"MSG a 1 r 0\r\n\r\n"])
def test_an_empty_header_or_payload_is_handed_over_as_nats_py_hands_it(frame: bytes) -> None:
    for chunks in ([frame], [frame[:9], frame[9:]]):
        assert run(FastParser, chunks) == run(Parser, chunks)
        assert len(run(FastParser, chunks)[0]) == 1


def test_a_reset_while_a_message_is_handled_drops_the_rest_of_the_read() -> None:
    stream = b"MSG a 1 1\r\nx\r\nMSG b 2 1\r\ny\r\n"
    calls, rest, _ = run(FastParser, [stream], reset_on_msg=1)
    assert calls == [("msg", 1, b"a", b"", b"x", None)]
    assert rest == b""


def test_a_payload_over_many_reads_arrives_whole() -> None:
    data = bytes(range(256)) * 4096  # 1 MiB: read in 32 KiB pieces, as the client reads
    stream = b"HMSG big 3 _INBOX.x 12 %d\r\nNATS/1.0\r\n\r\n" % (12 + len(data)) + data + b"\r\n"
    chunks = [stream[i:i + 32768] for i in range(0, len(stream), 32768)]
    calls, rest, error = run(FastParser, chunks)
    assert calls == [("msg", 3, b"big", b"_INBOX.x", data, b"NATS/1.0\r\n\r\n")]
    assert (rest, error) == (b"", "")


def test_the_client_reads_with_it() -> None:
    assert type(nats_io.Client()._ps) is FastParser
