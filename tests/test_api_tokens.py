"""The pure parts of API access: the tokens file, identity names, the loopback decision that
closes reads, and the redaction of env values in live events."""

from __future__ import annotations

import stat
from pathlib import Path

import msgspec
import pytest

from berth.services.dashboard_api import auth, redact
from berth.services.dashboard_api.auth import Caller
from berth.shared import api_tokens
from berth.shared.api_tokens import Role
from berth.shared.messages import AttemptReported, JobSpec, JobSubmitted, encode
from berth.shared.states import TaskState


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("LocalHost", True), ("localhost.", True),
    ("::ffff:127.0.0.1", True), (" 127.0.0.1 ", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.5", False),
    ("192.168.1.20", False), ("::ffff:10.0.0.1", False), ("fe80::1", False),
    # Names other than localhost may resolve anywhere, so they count as beyond loopback,
    # and so does an address written in a form that is not a plain literal.
    ("vm", False), ("dashboard.example.com", False), ("localhost.example.com", False),
    ("127.1", False),
])
def test_which_hosts_count_as_loopback(host: str, loopback: bool) -> None:
    assert auth.is_loopback(host) is loopback


@pytest.mark.parametrize(("host", "flag", "reason"), [
    ("127.0.0.1", False, None),
    ("127.0.0.1", True, "BERTH_API_CLOSED_READS is set"),
    ("0.0.0.0", False, "BERTH_API_HOST='0.0.0.0' is not a loopback address"),
    ("0.0.0.0", True, "BERTH_API_HOST='0.0.0.0' is not a loopback address"),
])
def test_reads_are_closed_by_the_flag_or_by_a_host_beyond_loopback(
        host: str, flag: bool, reason: str | None) -> None:
    assert auth.closed_reads_reason(host, flag) == reason


@pytest.mark.parametrize("name", ["ada", "A_b-9", "x" * 64])
def test_identity_names_that_can_be_subject_tokens(name: str) -> None:
    assert api_tokens.check_name(name) == name


@pytest.mark.parametrize("name", ["", "x" * 65, "a.b", "a b", "a*", "a>", "ä", "a/b"])
def test_identity_names_that_cannot(name: str) -> None:
    with pytest.raises(ValueError, match=r"^name: .* must be 1-64 letters, digits"):
        api_tokens.check_name(name)


def test_the_file_holds_hashes_owner_only_and_looks_tokens_up(tmp_path: Path) -> None:
    path = tmp_path / "auth" / "api-tokens.json"
    ada = api_tokens.create(path, "ada", Role.SUBMIT)
    rita = api_tokens.create(path, "rita", Role.READ)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert ada not in text and rita not in text and api_tokens.digest(ada) in text
    with pytest.raises(ValueError, match="'ada' already has a token"):
        api_tokens.create(path, "ada", Role.ADMIN)

    tokens = auth.Tokens("the-admin-token", path)
    tokens.load()
    assert tokens.lookup(ada) == Caller("ada", Role.SUBMIT)
    assert tokens.lookup(rita) == Caller("rita", Role.READ)
    assert tokens.lookup("the-admin-token") == Caller("admin", Role.ADMIN)
    assert tokens.lookup(ada + "x") is None and tokens.lookup("") is None

    # Changes count at the next lookup, however quickly they follow each other.
    api_tokens.revoke(path, "ada")
    assert tokens.lookup(ada) is None
    carl = api_tokens.create(path, "carl", Role.ADMIN)
    assert tokens.lookup(carl) == Caller("carl", Role.ADMIN)
    with pytest.raises(ValueError, match="no token named 'ada'"):
        api_tokens.revoke(path, "ada")


@pytest.mark.parametrize(("content", "says"), [
    ("not json", "not a tokens file"),
    ('{"v": 2, "tokens": []}', "v: 2 is not 1"),
    ('{"v": 1, "tokens": [{"name": "a", "role": "root", "sha256": "x"}]}',
     "not a tokens file: Invalid enum value 'root'"),
    ('{"v": 1, "tokens": [{"name": "a.b", "role": "read", "sha256": "x"}]}',
     "name: 'a.b' must be"),
])
def test_a_broken_file_is_one_line_naming_it(tmp_path: Path, content: str, says: str) -> None:
    path = tmp_path / "api-tokens.json"
    path.write_text(content)
    with pytest.raises(api_tokens.TokensFileError) as raised:
        api_tokens.load(path)
    assert str(raised.value).startswith(f"{path}: ") and says in str(raised.value)
    assert "\n" not in str(raised.value)


def test_no_file_is_no_tokens(tmp_path: Path) -> None:
    assert api_tokens.load(tmp_path / "none.json").tokens == []
    tokens = auth.Tokens("", tmp_path / "none.json")
    assert not tokens.configured and tokens.lookup("anything") is None


SPEC = JobSpec(name="j", command=["true"], user="ada", env={"KEY": "secret", "MODE": "x"})
SUBMITTED = encode(JobSubmitted(job_id="j1-abcd", submit_seq=1, spec=SPEC))


@pytest.mark.parametrize(("who", "sees"), [
    (None, False), (Caller("rita", Role.READ), False), (Caller("ada", Role.READ), False),
    (Caller("bob", Role.SUBMIT), False), (Caller("ada", Role.SUBMIT), True),
    (Caller("admin", Role.ADMIN), True),
])
def test_a_submitted_event_shows_env_values_only_to_owner_and_admin(
        who: Caller | None, sees: bool) -> None:
    shown = redact.event_for(who, SUBMITTED)
    assert shown is not None
    env = msgspec.json.decode(shown)["spec"]["env"]
    assert env == ({"KEY": "secret", "MODE": "x"} if sees
                   else {"KEY": redact.REDACTED, "MODE": redact.REDACTED})


def test_events_are_redacted_however_their_json_is_spelled() -> None:
    # The same event with its tag escaped and moved last: still recognised, still redacted.
    fields = msgspec.json.decode(SUBMITTED)
    del fields["type"]
    respelled = msgspec.json.encode(fields)[:-1] + b',"type":"job\\u005fsubmitted"}'
    shown = redact.event_for(None, respelled)
    assert shown is not None and b"secret" not in shown
    # Other events pass unchanged; what cannot be read is not sent at all.
    other = encode(AttemptReported(job_id="j1-abcd", task_index=0, attempt_id=1,
                                   worker_id="w", state=TaskState.RUNNING))
    assert redact.event_for(None, other) is other
    for unreadable in (b"not json", b"[1]", b'{"type": 5}',
                       b'{"type":"job_submitted","spec":{"env":{"K":"secret"}}}'):
        assert redact.event_for(None, unreadable) is None


def test_a_file_others_may_write_is_warned_about(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "api-tokens.json"
    api_tokens.create(path, "ada", Role.READ)
    tokens = auth.Tokens("", path)
    tokens.load()
    assert "chmod 600" not in caplog.text
    path.chmod(0o440)  # a Kubernetes Secret mounted for the pod's group: fine
    tokens.load()
    assert "chmod 600" not in caplog.text
    path.chmod(0o664)
    tokens.load()
    assert f"{path} is writable by others or readable by everyone: chmod 600 it" in caplog.text
