"""Tokens, roles and env redaction through a real dashboard process: tokens minted and revoked
with `berth token` while it runs, what each role may do over HTTP, env values that reach
only an admin or the job's own user on every path, and reads that close by themselves when
the API listens beyond loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from nats.aio.client import Client as NATS

from berth.services.dashboard_api.redact import REDACTED
from berth.shared import nats_io
from berth.stack import Stack, service_command, wait_for_api
from tests.conftest import wait_for_job, wait_until
from tests.test_cli import run_berth
from tests.test_dashboard_api import read_sse

SECRET = "s3cr3t-value-4711"
SLEEPER = {"name": "sleeper", "command": ["sleep", "60"],
           "resources": {"cpu": 0.25, "memory_mb": 32}}


def mint(stack: Stack, name: str, role: str) -> str:
    result = run_berth("--data-dir", str(stack.data_dir), "token", "create", name,
                       "--role", role, timeout=30)
    assert result.returncode == 0, result.stderr
    token = result.stdout.strip()
    assert token and "shown only this once" in result.stderr
    return token


def auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def post(stack: Stack, path: str, token: str | None, body: dict[str, Any] | None = None
         ) -> httpx.Response:
    return httpx.post(stack.api_url + path, json=body, headers=auth(token), timeout=20)


def get(stack: Stack, path: str, token: str | None) -> httpx.Response:
    return httpx.get(stack.api_url + path, headers=auth(token), timeout=10)


async def test_roles_decide_who_submits_and_cancels_and_tokens_change_live(
        make_stack: Any) -> None:
    stack: Stack = make_stack(workers=1)
    admin = stack.api_token
    # Minted while the dashboard runs: usable at once, no restart.
    ada, bob, rita = mint(stack, "ada", "submit"), mint(stack, "bob", "submit"), \
        mint(stack, "rita", "read")
    listed = run_berth("--data-dir", str(stack.data_dir), "token", "list").stdout
    assert [line.split()[:2] for line in listed.splitlines()] == [
        ["ada", "submit"], ["bob", "submit"], ["rita", "read"]]
    assert ada not in listed and ada not in (stack.data_dir / "auth" /
                                             "api-tokens.json").read_text()
    # The bus identities too, for scripts: the public half only (never a seed).
    creds = run_berth("--data-dir", str(stack.data_dir), "creds", "list", "--json")
    identities = {i["name"]: i for i in json.loads(creds.stdout)}
    assert {"scheduler", "dashboard", "worker-local-0"} <= set(identities), creds.stdout
    assert identities["worker-local-0"]["role"] == "worker"
    assert identities["worker-local-0"]["scope"] == "local-0"
    assert "seed" not in creds.stdout.lower()

    # read: reads, but no actions.
    assert get(stack, "/api/jobs", rita).status_code == 200
    denied = post(stack, "/api/jobs", rita, SLEEPER)
    assert denied.status_code == 403, denied.text
    assert "'rita' has role read" in denied.json()["detail"]

    # submit: the job's user is the token's identity; naming another user is refused.
    created = post(stack, "/api/jobs", ada, SLEEPER)
    assert created.status_code == 201, created.text
    mine = created.json()["job_id"]
    assert get(stack, f"/api/jobs/{mine}", None).json()["user"] == "ada"
    spoofed = post(stack, "/api/jobs", ada, {**SLEEPER, "user": "bob"})
    assert spoofed.status_code == 403
    assert spoofed.json()["detail"].startswith("user: 'bob' is not this token's identity")
    second = post(stack, "/api/jobs", ada, {**SLEEPER, "user": "ada"}).json()["job_id"]

    # admin: any user, or its own identity when none is named.
    carl = post(stack, "/api/jobs", admin, {**SLEEPER, "user": "carl"}).json()["job_id"]
    assert get(stack, f"/api/jobs/{carl}", None).json()["user"] == "carl"
    own = post(stack, "/api/jobs", admin, {**SLEEPER, "command": ["true"]}).json()["job_id"]
    assert get(stack, f"/api/jobs/{own}", None).json()["user"] == "admin"

    # Cancelling: a submit token only its own jobs; an admin any.
    for token, who in ((bob, "'bob' (role submit)"), (rita, "'rita' has role read")):
        refused = post(stack, f"/api/jobs/{mine}/cancel", token)
        assert refused.status_code == 403, refused.text
        assert who in refused.json()["detail"]
    assert "belongs to user 'ada'" in post(stack, f"/api/jobs/{mine}/cancel", bob).text
    as_other = post(stack, f"/api/jobs/{mine}/cancel", ada, {"user": "bob"})
    assert as_other.status_code == 403 and "user: 'bob'" in as_other.json()["detail"]
    assert post(stack, f"/api/jobs/{mine}/cancel", ada).status_code == 202
    assert post(stack, f"/api/jobs/{second}/cancel", admin).status_code == 202
    assert post(stack, f"/api/jobs/{carl}/cancel", admin).status_code == 202
    for job_id in (mine, second, carl):
        await wait_for_job(stack, job_id, {"killed"})

    # Revoked: refused at once, on reads as well as actions.
    result = run_berth("--data-dir", str(stack.data_dir), "token", "revoke", "bob")
    assert result.returncode == 0, result.stderr
    for resp in (get(stack, "/api/jobs", bob), post(stack, "/api/jobs", bob, SLEEPER)):
        assert resp.status_code == 401
        assert "not known" in resp.json()["detail"]
    assert get(stack, "/api/jobs", ada).status_code == 200
    # A token that is not one is a 401 even where reads are open, never a silent anonymous.
    assert get(stack, "/api/jobs", "guess").status_code == 401
    assert get(stack, "/api/jobs", None).status_code == 200


def leaks(resp: httpx.Response) -> bool:
    return SECRET in resp.text


async def test_env_values_reach_only_the_owner_and_admins_on_every_path(
        make_stack: Any, nc: NATS) -> None:
    stack: Stack = make_stack(workers=1, extra_env={"BERTH_SNAPSHOT_INTERVAL": "0.5"})
    ada, bob, rita = mint(stack, "ada", "submit"), mint(stack, "bob", "submit"), \
        mint(stack, "rita", "read")
    job = {"name": "secretive", "command": ["sh", "-c", "echo ran"],
           "env": {"API_KEY": SECRET, "MODE": "fast"},
           "resources": {"cpu": 0.25, "memory_mb": 32}}
    created = post(stack, "/api/jobs", ada, job)
    assert created.status_code == 201, created.text
    assert not leaks(created)
    job_id, outcome = created.json()["job_id"], created.json()["outcome"]
    await wait_for_job(stack, job_id, {"succeeded"})
    last = await nats_io.last_event_seq(nc.jetstream())
    redacted = {"API_KEY": REDACTED, "MODE": REDACTED}
    shown = {"API_KEY": SECRET, "MODE": "fast"}

    def submitted_env(events: list[tuple[int, dict[str, Any]]]) -> dict[str, str]:
        [env] = [data["spec"]["env"] for _, data in events if data["type"] == "job_submitted"]
        return dict(env)

    async def check(who: str, token: str | None, expected: dict[str, str]) -> None:
        detail = get(stack, f"/api/jobs/{job_id}", token)
        assert detail.json()["spec"]["env"] == expected, who
        # The rest of the spec is shown to every reader.
        assert detail.json()["spec"]["command"] == job["command"], who
        async with httpx.AsyncClient(timeout=30) as client:
            events = await read_sse(client, f"{stack.api_url}/api/events?after=0", last,
                                    headers=auth(token))
        assert submitted_env(events) == expected, who
        if expected == redacted:
            for path in ("/api/jobs", "/api/jobs?user=ada", f"/api/jobs/{job_id}/tasks/0",
                         f"/api/jobs/{job_id}/tasks/0/logs", outcome):
                resp = get(stack, path, token)
                assert resp.status_code == 200 and not leaks(resp), (who, path)

    for who, token in (("anonymous", None), ("read", rita), ("another submitter", bob)):
        await check(who, token, redacted)
    for who, token in (("owner", ada), ("admin", stack.api_token)):
        await check(who, token, shown)

    # After a restart the live stream serves these events from the stream itself, not from
    # memory: redacted there too.
    stack.stop_child("dashboard")
    stack.start_service("dashboard")
    wait_for_api(stack)
    async with httpx.AsyncClient(timeout=30) as client:
        events = await read_sse(client, f"{stack.api_url}/api/events",
                                last - 1, headers={"Last-Event-ID": "1"})
        assert submitted_env(events) == redacted
        events = await read_sse(client, f"{stack.api_url}/api/events", last - 1,
                                headers={"Last-Event-ID": "1", **auth(ada)})
        assert submitted_env(events) == shown


def loopback_alias() -> str | None:
    """This machine's hostname when it resolves only to loopback addresses: a host the
    dashboard treats as beyond loopback (it is not a literal loopback address) while it
    still binds to loopback only."""
    name = socket.gethostname()
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
    except OSError:
        return None
    return name if addresses and all(a.startswith("127.") for a in addresses) else None


async def test_reads_close_by_themselves_beyond_loopback(make_stack: Any) -> None:
    host = loopback_alias()
    if host is None:
        pytest.skip("the hostname does not resolve to loopback only; see "
                    "test_api_tokens.py for the decision itself")
    stack: Stack = make_stack(workers=0, extra_env={"BERTH_API_HOST": host})
    rita = mint(stack, "rita", "read")
    for path in ("/api/jobs", "/api/workers", "/api/events", "/api/submits/1"):
        resp = get(stack, path, None)
        assert resp.status_code == 401, path
        assert "reads are closed" in resp.json()["detail"], path
    assert get(stack, "/api/workers", rita).status_code == 200
    # The page and liveness stay open; the page asks for the token.
    assert get(stack, "/", None).status_code == 200
    assert get(stack, "/healthz", None).status_code == 200
    log = (stack.data_dir / "logs" / "dashboard.log").read_text()
    assert f"reads need a bearer token: BERTH_API_HOST={host!r} is not a loopback" in log


def start_dashboard(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    # Nothing listens on port 1: should a check not stop it, it fails to connect instead of
    # binding anywhere.
    base = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_")}
    return subprocess.run(
        service_command("dashboard"), capture_output=True, text=True,
        timeout=30, env={**base, "BERTH_DATA_DIR": str(tmp_path), "BERTH_API_PORT": "1",
                         "BERTH_NATS_URL": "nats://127.0.0.1:1", **env})


@pytest.mark.parametrize(("env", "says"), [
    ({"BERTH_API_CLOSED_READS": "1"},
     "reads need a token (BERTH_API_CLOSED_READS is set) and none exists"),
    ({"BERTH_API_HOST": "berth-test.invalid"},
     "reads need a token (BERTH_API_HOST='berth-test.invalid' is not a loopback address)"),
])
def test_closed_reads_without_any_token_refuse_to_start(
        tmp_path: Path, env: dict[str, str], says: str) -> None:
    result = start_dashboard(tmp_path, **env)
    assert result.returncode == 1
    assert says in result.stderr and "Traceback" not in result.stderr


def test_a_broken_tokens_file_is_one_line_at_start(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    path.write_text('{"v": 1, "tokens": [{"name": "a b", "role": "read", "sha256": "x"}]}')
    result = start_dashboard(tmp_path, BERTH_API_TOKENS_FILE=str(path))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"{path}: name: 'a b' must be" in result.stderr.strip().splitlines()[-1]


async def test_a_tokens_file_broken_while_running_lets_no_file_token_in(
        make_stack: Any) -> None:
    stack: Stack = make_stack(workers=0)
    ada = mint(stack, "ada", "submit")
    assert get(stack, "/api/jobs", ada).status_code == 200
    path = stack.data_dir / "auth" / "api-tokens.json"
    path.write_text(path.read_text().replace('"submit"', '"superuser"'))
    assert get(stack, "/api/jobs", ada).status_code == 401
    assert get(stack, "/api/jobs", stack.api_token).status_code == 200
    log = stack.data_dir / "logs" / "dashboard.log"
    await wait_until(lambda: "file tokens refused until fixed" in log.read_text(),
                     what="the error logged")


def test_berth_token_says_what_is_wrong_in_one_line(tmp_path: Path) -> None:
    data = ["--data-dir", str(tmp_path)]
    for args, says in (
            (["create", "a.b"], "berth: name: 'a.b' must be 1-64 letters, digits, '_' or '-'"),
            (["revoke", "nobody"], "berth: name: no token named 'nobody'"),
    ):
        result = run_berth(*data, "token", *args, timeout=30)
        assert result.returncode == 1 and result.stdout == ""
        assert result.stderr.strip().startswith(says), result.stderr
    bad_role = run_berth(*data, "token", "create", "ada", "--role", "root", timeout=30)
    assert bad_role.returncode == 2 and "'root' is not one of" in bad_role.stderr
    (tmp_path / "auth").mkdir(exist_ok=True)
    (tmp_path / "auth" / "api-tokens.json").write_text("[]")
    listed = run_berth(*data, "token", "list", timeout=30)
    assert listed.returncode == 1 and "Traceback" not in listed.stderr
    assert "api-tokens.json: not a tokens file" in listed.stderr
