"""The whole system, every part real: nats-server, a Redis-compatible server, the four
services and worker agents as processes, HTTP to the dashboard API."""

from __future__ import annotations

import json
import os
import signal

import httpx
import msgspec
import pytest
from nats.aio.client import Client as NATS

from berth.client import publish_submit, submit_job, wait_for_outcome
from berth.shared.messages import JobSpec, Resources
from berth.stack import Stack
from tests.conftest import get_json, wait_for_job, wait_until


async def test_three_replicas_succeed_on_two_workers(make_stack, nc: NATS) -> None:
    """Also scrapes every service's metrics endpoint over HTTP (docs/metrics.md)."""
    stack: Stack = make_stack(workers=2, metrics=True)
    await wait_until(lambda: len(get_json(stack, "/api/workers")) == 2, what="2 workers")
    assert set(stack.metrics_urls) == {"submitter", "scheduler", "dashboard", "local-0",
                                       "local-1"}
    # The workers register without the scheduler: on a loaded machine its endpoint may not
    # be listening yet (seen once in CI).
    placed_before = (await wait_until(lambda: scrape_when_up(stack.metrics_urls["scheduler"]),
                                      what="the scheduler's metrics endpoint")
                     )["berth_scheduler_placements_total"]
    spec = JobSpec(
        name="three", replicas=3, resources=Resources(cpu=0.5, memory_mb=64),
        command=["python3", "-c", "import os; print('task', os.environ['BERTH_TASK_INDEX'])"],
    )
    outcome = await submit_job(nc, spec)
    assert outcome.accepted, outcome.reason
    job = await wait_for_job(stack, str(outcome.job_id), {"succeeded", "failed"})
    assert job["state"] == "succeeded"
    assert job["task_counts"] == {"succeeded": 3}
    assert [t["state"] for t in job["tasks"]] == ["succeeded"] * 3
    workers_used = {t["attempts"][-1]["worker_id"] for t in job["tasks"]}
    assert workers_used == {"local-0", "local-1"}, "replicas spread over both workers"
    for task in job["tasks"]:
        assert task["attempts"][-1]["exit_code"] == 0
        logs = await wait_until(
            lambda t=task: get_text(stack, f"/api/jobs/{job['job_id']}/tasks/{t['index']}/logs"),
            what="task output",
        )
        assert logs.strip() == f"task {task['index']}"
    listed = get_json(stack, "/api/jobs")
    assert [j["job_id"] for j in listed["jobs"]] == [job["job_id"]]
    assert listed["next_cursor"] is None
    # Every reservation was released once the workers confirmed the exits.
    workers = get_json(stack, "/api/workers")
    assert all(w["cpu_free"] == 2.0 and w["running_attempts"] == [] for w in workers)
    check_metrics(stack, placed_before)


def scrape_when_up(url: str) -> dict[str, float] | None:
    """`scrape`, or None while nothing listens at `url` yet."""
    try:
        return scrape(url)
    except httpx.ConnectError:
        return None


def scrape(url: str) -> dict[str, float]:
    """One endpoint's samples, parsed by prometheus-client's own parser, keyed by name and
    labels (`name{a="x"}`)."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = SCRAPER.get(url)
    assert resp.status_code == 200, f"{url}: {resp.status_code} {resp.text[:200]}"
    samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def check_metrics(stack: Stack, placed_before: float) -> None:
    scheduler = scrape(stack.metrics_urls["scheduler"])
    assert scheduler["berth_scheduler_placements_total"] == placed_before + 3
    assert scheduler["berth_refused_double_bookings"] == 0
    assert scheduler["berth_scheduler_leader"] == 1
    assert scheduler["berth_heartbeat_interval_seconds"] == 0.5  # two workers: not paced
    assert scheduler["berth_scheduler_tick_seconds_count"] >= 1
    assert scheduler['berth_pending_tasks{band="batch"}'] == 0
    assert scheduler['berth_workers{state="in_service"}'] == 2
    assert scheduler["berth_fold_lag"] >= 0
    assert scheduler["berth_events_folded_total"] >= scheduler["berth_fold_seq"] > 0
    assert 0 <= scheduler['berth_worker_heartbeat_age_seconds{worker="local-0"}'] < 3
    submitter = scrape(stack.metrics_urls["submitter"])
    assert submitter['berth_submits_total{kind="job",outcome="accepted"}'] == 1
    assert "berth_publish_retries_total" in submitter
    succeeded = 0.0
    for worker in ("local-0", "local-1"):
        agent = scrape(stack.metrics_urls[worker])
        assert agent['berth_worker_heartbeats_total{outcome="acknowledged"}'] >= 1
        assert agent[f'berth_worker_attempts_running{{worker="{worker}"}}'] == 0
        succeeded += agent.get('berth_worker_reports_total{state="succeeded"}', 0)
    assert succeeded == 3
    # The dashboard serves the same on its API port, with its requests' latency.
    for url in (stack.metrics_urls["dashboard"], stack.api_url + "/metrics"):
        dashboard = scrape(url)
        assert dashboard["berth_dashboard_caught_up"] == 1
        assert dashboard["berth_events_folded_total"] >= dashboard["berth_fold_seq"] > 0
        assert dashboard['berth_workers{state="in_service"}'] == 2
        assert dashboard["berth_fold_lag"] >= 0
        assert any(k.startswith("berth_dashboard_request_duration_seconds_count{")
                   and 'path="/api/jobs/{job_id}"' in k for k in dashboard), \
            "request latency by route"


# One client for every scrape: a new httpx client builds a TLS context each time.
SCRAPER = httpx.Client(timeout=10)


def get_text(stack: Stack, path: str) -> str:
    import httpx

    return httpx.get(stack.api_url + path, timeout=10).text


async def test_exit_code_3_ends_failed_with_the_code(make_stack, nc: NATS) -> None:
    stack: Stack = make_stack(workers=1)
    spec = JobSpec(name="exit3", command=["python3", "-c", "import sys; sys.exit(3)"],
                   resources=Resources(cpu=0.5, memory_mb=64))
    outcome = await submit_job(nc, spec)
    job = await wait_for_job(stack, str(outcome.job_id), {"succeeded", "failed"})
    assert job["state"] == "failed"
    task = job["tasks"][0]
    assert task["state"] == "failed"
    assert task["exit_code"] == 3
    assert task["attempts"][0]["exit_code"] == 3
    assert "exited with code 3" in task["error"]


async def test_missing_executable_fails_with_a_clear_error(make_stack, nc: NATS) -> None:
    stack: Stack = make_stack(workers=1)
    spec = JobSpec(name="nosuch", command=["/nonexistent/berth-test-binary"],
                   resources=Resources(cpu=0.5, memory_mb=64))
    outcome = await submit_job(nc, spec)
    job = await wait_for_job(stack, str(outcome.job_id), {"succeeded", "failed"})
    assert job["state"] == "failed"
    assert "cannot start '/nonexistent/berth-test-binary'" in job["tasks"][0]["error"]


BAD_SUBMITS = [
    pytest.param(b'{"name": "x", "command": ["true"', "malformed JSON", id="malformed-json"),
    pytest.param(b'{"name": "x"}', "missing required field `command`", id="missing-command"),
    pytest.param(b'{"name": "x", "command": ["true"], "resources": {"cpu": -1}}',
                 "at `$.resources.cpu`", id="negative-cpu"),
    pytest.param(b'{"name": "x", "command": ["true"], "replicas": 0}',
                 "at `$.replicas`", id="zero-replicas"),
    pytest.param(b'{"name": "x", "command": ["true"], "replica": 2}',
                 "unknown field `replica`", id="unknown-field"),
    pytest.param(b"[1, 2]", "Expected `object`", id="not-an-object"),
    pytest.param(json.dumps({"name": "big", "command": ["echo", "x" * 300_000]}).encode(),
                 "the limit is 262144 bytes", id="oversized"),
]


@pytest.mark.parametrize(("payload", "expected"), BAD_SUBMITS)
async def test_bad_submit_is_rejected_and_the_next_job_runs(
    make_stack, nc: NATS, payload: bytes, expected: str
) -> None:
    stack: Stack = make_stack(workers=1)
    seq = await publish_submit(nc, payload)
    outcome = await wait_for_outcome(nc, seq)
    assert not outcome.accepted
    assert expected in str(outcome.reason)
    # The rejection is also visible over HTTP, by submit sequence.
    seen = await wait_until(lambda: get_submit(stack, seq), what="rejection in the API")
    assert seen["accepted"] is False and expected in seen["reason"]
    # The submitter keeps serving: a valid job right after is accepted and runs.
    good = await submit_job(nc, JobSpec(name="after", command=["true"],
                                        resources=Resources(cpu=0.5, memory_mb=64)))
    assert good.accepted
    job = await wait_for_job(stack, str(good.job_id), {"succeeded", "failed"})
    assert job["state"] == "succeeded"
    assert stack.children["submitter"].poll() is None


def get_submit(stack: Stack, seq: int) -> dict[str, object] | None:
    import httpx

    resp = httpx.get(f"{stack.api_url}/api/submits/{seq}", timeout=10)
    return resp.json() if resp.status_code == 200 else None


async def test_duplicate_submit_with_same_msg_id_makes_one_job(make_stack, nc: NATS) -> None:
    stack: Stack = make_stack(workers=1)
    payload = msgspec.json.encode(JobSpec(name="once", command=["true"],
                                          resources=Resources(cpu=0.5, memory_mb=64)))
    first = await publish_submit(nc, payload, msg_id="client-request-42")
    second = await publish_submit(nc, payload, msg_id="client-request-42")
    assert first == second, "JetStream dedups on Nats-Msg-Id"
    outcome = await wait_for_outcome(nc, first)
    await wait_for_job(stack, str(outcome.job_id), {"succeeded"})
    assert len(get_json(stack, "/api/jobs")["jobs"]) == 1


async def test_api_answers_404_for_unknown_ids(make_stack) -> None:
    import httpx

    stack: Stack = make_stack(workers=0)
    for path in ("/api/jobs/nope", "/api/jobs/nope/tasks/0/logs", "/api/submits/999"):
        resp = httpx.get(stack.api_url + path, timeout=10)
        assert resp.status_code == 404, path
        assert "detail" in resp.json()
    resp = httpx.get(stack.api_url + "/api/jobs?state=bogus", timeout=10)
    assert resp.status_code == 400
    assert "state" in resp.text
    assert httpx.get(stack.api_url + "/healthz", timeout=10).json()["status"] == "ok"
    assert httpx.get(stack.api_url + "/schema/openapi.json", timeout=10).status_code == 200


async def test_stopped_worker_fails_over_to_another_worker(make_stack, nc: NATS,
                                                           tmp_path) -> None:
    stack: Stack = make_stack(workers=2)
    await wait_until(lambda: len(get_json(stack, "/api/workers")) == 2, what="2 workers")
    pid_file = tmp_path / "attempt0.pid"
    script = (
        "import os, time, pathlib\n"
        "if os.environ['BERTH_ATTEMPT_ID'] == '0':\n"
        f"    pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\n"
        "    time.sleep(60)\n"
    )
    outcome = await submit_job(nc, JobSpec(name="failover", command=["python3", "-c", script],
                                           resources=Resources(cpu=0.5, memory_mb=64)))
    job = await wait_for_job(stack, str(outcome.job_id), {"running"})
    await wait_until(lambda: pid_file.exists() and pid_file.read_text(), what="attempt 0 pid")
    first_worker = job["tasks"][0]["attempts"][0]["worker_id"]
    pid = int(pid_file.read_text())

    stack.children[first_worker].send_signal(signal.SIGTERM)
    job = await wait_for_job(stack, str(outcome.job_id), {"succeeded", "failed"}, timeout=40)
    assert job["state"] == "succeeded"
    task = job["tasks"][0]
    assert task["preemption_count"] == 1 and task["failure_count"] == 0
    first, second = task["attempts"]
    assert first["state"] == "worker_failed" and first["worker_failure"] is True
    assert second["state"] == "succeeded" and second["worker_id"] != first_worker
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the worker really stopped attempt 0's process
    assert stack.children[first_worker].wait(10) == 0


async def test_in_constraints_place_and_wait_and_the_scheduler_stays_up(make_stack,
                                                                        nc: NATS) -> None:
    """A task with an IN constraint once stopped the leader's tick (and every scheduler
    after it, on the same waiting job): the fault suite's fuzzed submits found it."""
    from berth.shared.messages import Constraint, Op

    stack: Stack = make_stack(workers=0)
    stack.start_worker("zoned", 1, 512, "-a", "zone=us-a")
    small = Resources(cpu=0.1, memory_mb=32)
    waiting = await submit_job(nc, JobSpec(name="eu", command=["true"], resources=small,
                                           constraints=[Constraint(key="zone", op=Op.IN,
                                                                   values=["eu"])]))
    runs = await submit_job(nc, JobSpec(name="us", command=["true"], resources=small,
                                        constraints=[Constraint(key="zone", op=Op.IN,
                                                                values=["us-b", "us-a"])]))
    await wait_for_job(stack, str(runs.job_id), {"succeeded"})

    def reason() -> str:
        job = get_json(stack, f"/api/jobs/{waiting.job_id}")
        return str(job["tasks"][0].get("pending_reason") or "")

    await wait_until(lambda: "zone IN [eu]" in reason(), what="the eu job's pending reason")
    assert stack.children["scheduler"].poll() is None
