"""shared/nats_frames.py builds the bytes nats-py 2.x would send for a publish, for any
subject, reply, payload and headers, and refuses what nats-py refuses."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from nats import errors
from nats.aio.client import Client as NATS

from berth.shared import nats_frames, nats_io

# Subjects and replies as nats-py's publish takes them: no whitespace (any other character,
# wildcards and empty tokens included: the server judges those).
subject = st.text(st.characters(blacklist_characters=" \t\r\n", blacklist_categories=["Cs"]),
                  min_size=1, max_size=30)
token = st.text("!#$%&'*+-.^_`|~09AZaz", min_size=1, max_size=12)
name = st.one_of(token, token.map(lambda t: f" {t}\t"), st.just(""), st.just("  "),
                 st.text(st.characters(blacklist_categories=["Cs"]), max_size=8))
value = st.text(st.characters(blacklist_categories=["Cs"]), max_size=24)
headers = st.one_of(st.none(), st.dictionaries(name, value, max_size=4))


async def nats_py_frame(subject: str, reply: str, payload: bytes,
                        headers: dict[str, str] | None) -> bytes | type[Exception]:
    """What nats-py's own `_send_publish` queues for this publish, or the error it raises."""
    client: Any = NATS()
    sent: list[bytes] = []

    async def capture(cmd: bytes, priority: bool = False) -> None:
        sent.append(cmd)

    client._send_command = capture
    client._flush_queue = None
    try:
        await NATS._send_publish(client, subject, reply, payload, len(payload), headers)
    except errors.Error as exc:
        return type(exc)
    return b"".join(sent)


def our_frame(subject: str, reply: str, payload: bytes,
              headers: dict[str, str] | None) -> bytes | type[Exception]:
    try:
        return nats_frames.publish_frame(subject, reply, payload, headers)
    except errors.Error as exc:
        return type(exc)


@given(subject, st.one_of(st.just(""), subject), st.binary(max_size=64), headers)
@example("berth.events.attempt.sim-00001", "_INBOX.a.b.1", b'{"state":3}',
         {"Nats-Msg-Id": "report:j1/0/0:RUNNING", "Nats-Expected-Stream": "BERTH_EVENTS"})
@example("s", "", b"", {})  # an empty headers dict is still an HPUB
@example("s", "", b"x", {"Bad Name": "v"})
@example("s", "", b"x", {"N": " a\r\nb \n"})
async def test_the_same_bytes_as_nats_py(subject: str, reply: str, payload: bytes,
                                         headers: dict[str, str] | None) -> None:
    assert our_frame(subject, reply, payload, headers) == await nats_py_frame(
        subject, reply, payload, headers)


@pytest.mark.parametrize(("subject", "reply", "ok"), [
    ("berth.a", "", True), ("berth.a", "_INBOX.x", True), ("", "", False),
    ("berth a", "", False), ("berth.a\r\nPUB x 1", "", False), ("berth.a", "in box", False),
    ("berth.a", "in\tbox", False),
])
async def test_a_subject_or_reply_with_whitespace_is_refused_as_nats_py_refuses_it(
        subject: str, reply: str, ok: bool) -> None:
    for client in (NATS(), nats_io.Client()):
        try:
            await client.publish(subject, b"x", reply=reply)
        except errors.BadSubjectError:
            assert not ok
        except errors.Error:
            assert ok  # past the subject checks: an unconnected client refuses later
        else:
            raise AssertionError("an unconnected client published")
