"""berth's NATS client parses message headers exactly as nats-py does, only faster
(shared/nats_io.py `Client`): every events-stream message carries headers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NatsPyClient

from berth.shared import nats_io

# Header blocks built from the bytes that matter: separators, whitespace of every kind
# (str.isspace counts \x1c-\x1f, bytes.strip does not), non-ASCII and ordinary letters.
ALPHABET = [b"\r\n", b":", b" ", b"\t", b"\x1c", b"\x0b", b"\xc3\xa9", b"\xff", b"a", b"-",
            b"Nats-Msg-Id", b"traceparent"]


@settings(max_examples=200)
@given(st.lists(st.sampled_from(ALPHABET), max_size=40))
def test_same_headers_as_nats_py(parts: list[bytes]) -> None:
    raw = b"".join(parts)
    assert nats_io.Client._parse_header_lines(raw) == NatsPyClient._parse_header_lines(raw)


def test_service_headers_parse() -> None:
    raw = b"Nats-Msg-Id: assign:3:j1/0/0\r\ntraceparent: 00-ab-cd-01\r\n\r\n"
    assert nats_io.Client._parse_header_lines(raw) == {
        "Nats-Msg-Id": "assign:3:j1/0/0", "traceparent": "00-ab-cd-01"}
