"""The `berth` command as a user runs it: real processes, real servers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from berth import cli
from berth.shared import redis_auth
from berth.shared.credentials import Role
from berth.stack import Stack
from tests.conftest import wait_until

# -P as the installed `berth` script has it: its sys.path starts at its bin/, not the cwd.
BERTH = [sys.executable, "-P", "-m", "berth.cli"]


def run_berth(*args: str, env: dict[str, str] | None = None, timeout: float = 120
              ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*BERTH, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_demo_runs_a_job_to_success_and_leaves_nothing_behind(tmp_path: Path) -> None:
    result = run_berth("--data-dir", str(tmp_path / "d"), "demo")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(demo): succeeded" in result.stdout
    assert result.stdout.count("hello from task") == 3
    assert not (tmp_path / "d" / "stack.json").exists()
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "d")], capture_output=True,
                               text=True)
    assert leftovers.stdout.strip() == ""


def test_schema_is_valid_json_schema_for_the_submit_message() -> None:
    result = run_berth("schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    job = schema["$defs"]["JobSpec"]
    assert set(job["required"]) == {"name", "command"}
    assert job["properties"]["replicas"]["minimum"] == 1


def test_help_lists_every_command() -> None:
    out = run_berth("--help").stdout
    for command in ("up", "demo", "submit", "cancel", "status", "workers", "device", "doctor",
                    "health", "creds", "backup", "restore", "token", "schema", "run", "cordon",
                    "drain", "uncordon", "schedules"):
        assert command in out
    assert "admin (everything)" in run_berth("token", "--help").stdout
    assert "--cpu" in run_berth("run", "worker", "--help").stdout
    assert "SIGKILL" in run_berth("cancel", "--help").stdout


def test_cancel_from_the_cli_kills_the_job_and_status_shows_the_history(
        make_stack, tmp_path: Path) -> None:
    stack: Stack = make_stack(workers=1)
    spec = tmp_path / "job.yaml"
    spec.write_text("name: sleepy\ncommand: [sleep, '300']\n"
                    "resources: {cpu: 0.5, memory_mb: 64}\n")
    env = {"BERTH_NATS_URL": stack.nats.url, "BERTH_API_URL": stack.api_url,
           "BERTH_NATS_CREDS": str(stack.creds_for(Role.SUBMIT, "ada"))}
    submitted = run_berth("submit", str(spec), env=env)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    wait_until_sync(lambda: "running" in run_berth("status", job_id, env=env).stdout)
    result = run_berth("cancel", job_id, "--reason", "not needed", "--wait", env=env)
    assert result.returncode == 0, result.stderr
    assert f"job {job_id} (sleepy): killed" in result.stdout
    assert "error: cancelled by ada: not needed" in result.stdout
    assert "attempt 0" in result.stdout and "local-0" in result.stdout
    unknown = run_berth("cancel", "j999-abcd", env=env)
    assert unknown.returncode == 1 and "rejected: job_id: no job 'j999-abcd'" in unknown.stderr
    typo = run_berth("cancel", "not-a-job", env=env)
    assert typo.returncode == 1 and "$.job_id" in typo.stderr


def wait_until_sync(predicate: object, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_submit_and_status_against_a_running_stack(
        make_stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stack: Stack = make_stack(workers=1)
    spec = tmp_path / "job.yaml"
    spec.write_text("name: cli\ncommand: [python3, -c, 'print(42)']\n"
                    "resources: {cpu: 0.5, memory_mb: 64}\nmax_retries_failure: 1\n"
                    "retry: {on_events: [error], backoff: {initial: 2s, max: 1m}}\n")
    # Beside the running stack, the command speaks as the local user `berth up` made.
    env = {"BERTH_DATA_DIR": str(stack.data_dir)}
    result = run_berth("submit", str(spec), "--wait", "--timeout", "60", env=env)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.splitlines()[0]
    assert f"job {job_id} (cli): succeeded" in result.stdout
    assert (f"job {job_id} retries on error with no time limit, waiting 2s, x2 each time "
            "up to 1m before each") in result.stderr
    status = run_berth("status", job_id, env=env)
    assert "task 0: succeeded" in status.stdout and "exit code 0" in status.stdout
    assert job_id in run_berth("status", env=env).stdout

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ncommand: []\n")
    result = run_berth("submit", str(bad), env=env)
    assert result.returncode == 1
    assert "rejected: invalid job spec: Expected `array` of length >= 1 - at `$.command`" in \
        result.stderr
    missing = run_berth("status", "j999-0000", env=env)
    assert missing.returncode == 1 and "404" in missing.stderr
    read_commands_on_the_same_stack(stack, job_id, tmp_path, capsys)


def berth_in_process(capsys: pytest.CaptureFixture[str], *args: str, fails: bool = False
                     ) -> tuple[int, str]:
    """`berth ARGS` in this process (the same entry point, a fraction of the start-up)."""
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    assert (code != 0) == fails, f"berth {' '.join(args)}: exit status {code}; {err}"
    assert out if not fails else len(err.strip().splitlines()) == 1, (out, err)
    return code, out


def read_commands_on_the_same_stack(stack: Stack, done: str, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """jobs, status, logs (-f, --stderr), workers, why, watch, each --json where it reads,
    and a global flag after the command, all against one running stack."""
    talker = tmp_path / "talker.json"
    program = ("import sys, time\nfor i in range(3):\n    print('out', i, flush=True)\n"
               "    print('err', i, file=sys.stderr, flush=True)\n    time.sleep(0.3)\n")
    talker.write_text(json.dumps({"name": "talker", "command": ["python3", "-c", program],
                                  "resources": {"cpu": 0.5, "memory_mb": 64}}))
    data = ["--data-dir", str(stack.data_dir)]
    talker_id = berth_in_process(capsys, *data, "submit", str(talker))[1].strip()
    # Followed from before the task has an attempt: it waits for one, then ends with it;
    # with a global flag after the command, as a user types it.
    follow = subprocess.run([*BERTH, "logs", talker_id, "0", "-f", "--api-url", stack.api_url],
                            capture_output=True, text=True, timeout=60)
    assert follow.returncode == 0, follow.stderr
    # stdout and stderr are read apart, so only each one's own order is certain.
    assert sorted(follow.stdout.splitlines()) == [f"{s} {i}" for s in ("err", "out")
                                                  for i in range(3)], follow.stdout
    api = ["--api-url", stack.api_url]
    _, out = berth_in_process(capsys, "logs", talker_id, "--stderr", *api)
    assert out.splitlines() == ["err 0", "err 1", "err 2"], out
    _, out = berth_in_process(capsys, "watch", talker_id, "--json", *api)
    assert json.loads(out)["state"] == "succeeded", out

    huge = tmp_path / "huge.yaml"
    huge.write_text("name: huge\ncommand: ['true']\nresources: {cpu: 64, memory_mb: 64}\n")
    huge_id = berth_in_process(capsys, *data, "submit", str(huge))[1].strip()
    code, out = berth_in_process(capsys, "--api-url", stack.api_url, "why", huge_id, "--json")
    why = json.loads(out)
    assert code == 0 and why["queue"] == {"band": "interactive", "position": 1, "of": 1}, why
    assert [t["index"] for t in why["pending"]] == [0]
    code, out = berth_in_process(capsys, "why", huge_id, "--api-url", stack.api_url)
    assert "position 1 of 1 in band interactive" in out and "task 0: " in out, out

    code, out = berth_in_process(capsys, "jobs", "--json", "--api-url", stack.api_url)
    listed = json.loads(out)["jobs"]
    assert [j["job_id"] for j in listed][:3] == [huge_id, talker_id, done]  # newest first
    code, out = berth_in_process(capsys, "jobs", "--json", "--state", "succeeded",
                                 "--name", "tal", "--api-url", stack.api_url)
    assert [j["job_id"] for j in json.loads(out)["jobs"]] == [talker_id]
    code, out = berth_in_process(capsys, "jobs", "--limit", "1", "--api-url", stack.api_url)
    assert huge_id in out and talker_id not in out
    code, out = berth_in_process(capsys, "status", talker_id, "--json", "--api-url",
                                 stack.api_url)
    detail = json.loads(out)
    assert detail["tasks"][0]["attempts"][0]["exit_code"] == 0
    code, out = berth_in_process(capsys, "workers", "--json", "--api-url", stack.api_url)
    (worker,) = json.loads(out)
    assert worker["worker_id"] == "local-0" and worker["last_heartbeat"]
    code, out = berth_in_process(capsys, "workers", "--api-url", stack.api_url)
    assert "local-0" in out and "healthy" in out and "s ago" in out, out
    code, out = berth_in_process(capsys, "doctor", "--json", "--data-dir", str(stack.data_dir),
                                 "--redis-url", stack.redis.url_for(redis_auth.DOCTOR))
    doctor = json.loads(out)
    assert doctor["ok"] and doctor["double_booked_hosts"] == 0, doctor
    code, out = berth_in_process(capsys, "--api-url", stack.api_url, "why", "j999-0000",
                                 fails=True)
    assert code == 1


@pytest.mark.parametrize("service", ["scheduler", "submitter", "dashboard"])
async def test_services_stop_cleanly_on_sigterm(make_stack, service: str) -> None:
    stack: Stack = make_stack(workers=0)
    proc = stack.children[service]
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert await wait_until(lambda: proc.poll() is not None, 15, f"{service} to exit")
    assert proc.returncode == 0
    del stack.children[service]


def test_a_submit_whose_fate_is_unknown_can_be_retried_without_a_second_job(
        make_stack, tmp_path: Path) -> None:
    stack: Stack = make_stack(workers=1)
    stack.stop_child("submitter")  # the submit is stored, but no one decides it yet
    spec = tmp_path / "job.yaml"
    spec.write_text("name: once\ncommand: ['true']\nresources: {cpu: 0.5, memory_mb: 64}\n")
    env = {"BERTH_DATA_DIR": str(stack.data_dir)}
    first = run_berth("submit", str(spec), "--submit-timeout", "6", env=env)
    assert first.returncode == 1
    last_line = first.stderr.strip().splitlines()[-1]
    assert "no verdict came within 6s" in last_line and "Traceback" not in first.stderr
    key = last_line.rsplit("--idempotency-key ", 1)[1]
    stack.start_service("submitter")
    again = run_berth("submit", str(spec), "--idempotency-key", key, env=env)
    assert again.returncode == 0, again.stderr
    same = run_berth("submit", str(spec), "--idempotency-key", key, env=env)
    assert same.stdout == again.stdout
    listed = run_berth("status", env=env).stdout
    assert listed.count(" once ") == 1, listed


def _closed_pipe(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Runs `berth ARGS | head -0`: the reader is gone before berth writes a byte."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    proc = subprocess.run([*BERTH, *args], stdout=write_end, stderr=subprocess.PIPE,
                          text=True, timeout=120, env={**os.environ, **(env or {})})
    os.close(write_end)
    return proc.returncode, proc.stderr


def test_a_closed_pipe_ends_quietly() -> None:
    code, err = _closed_pipe("schema")
    assert code == 128 + signal.SIGPIPE
    assert err == "", err  # no BrokenPipeError, no "Exception ignored"


def test_submit_from_stdin_cancel_of_an_ended_job_and_status_into_a_closed_pipe(
        make_stack, tmp_path: Path) -> None:
    stack: Stack = make_stack(workers=1)
    env = {"BERTH_DATA_DIR": str(stack.data_dir)}
    spec = '{"name": "from-stdin", "command": ["true"], "resources": {"cpu": 5e-1}}'
    result = subprocess.run([*BERTH, "submit", "-", "--wait", "--timeout", "60"],
                            input=spec, capture_output=True, text=True, timeout=120,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.splitlines()[0]
    assert f"job {job_id} (from-stdin): succeeded" in result.stdout

    ended = run_berth("cancel", job_id, env=env)
    assert ended.returncode == 1
    assert ended.stderr.strip() == f"berth: job {job_id} already ended (succeeded); " \
        "nothing to cancel"

    code, err = _closed_pipe("status", env=env)
    assert code == 128 + signal.SIGPIPE and err == "", err

    dup = tmp_path / "dup.yaml"
    dup.write_text("name: a\ncommand: ['true']\nname: b\n")
    refused = run_berth("submit", str(dup), env=env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip() == (f"berth: {dup}: not valid YAML: duplicate key 'name' "
                                      "(line 3, first given on line 1)")
