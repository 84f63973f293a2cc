"""The dashboard's HTTP API through real services: paging and filters, task and worker
detail, logs (tail and follow), Server-Sent Events resumed with Last-Event-ID, the bearer
token on actions (and on reads when closed), and 4xx bodies that name the problem."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import httpx
from nats.aio.client import Client as NATS

from berth.shared import nats_io
from berth.shared.messages import JobSpec
from berth.stack import Stack
from tests.conftest import get_json, wait_for_job, wait_until
from tests.test_lifecycle_e2e import SMALL, accepted


def spec(name: str, user: str = "", parent: str | None = None, **kw: Any) -> JobSpec:
    return JobSpec(name=name, user=user, parent=parent, command=kw.pop("command", ["true"]),
                   resources=SMALL, **kw)


def bearer(stack: Stack, token: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token if token is not None else stack.api_token}"}


async def test_job_list_filters_and_pages_newest_first(make_stack: Any, nc: NATS) -> None:
    stack: Stack = make_stack(workers=1)
    sweep = [await accepted(nc, spec(f"sweep-{i}", user="ada")) for i in range(5)]
    other = await accepted(nc, spec("other", user="bob", command=["false"]))
    child = await accepted(nc, spec("child", user="ada", parent=sweep[0]))
    for job_id in [*sweep, child]:
        await wait_for_job(stack, job_id, {"succeeded"})
    await wait_for_job(stack, other, {"failed"})
    newest_first = [child, other, *reversed(sweep)]

    # Walking the pages gives every job once, newest first.
    seen: list[str] = []
    cursor = ""
    while True:
        page = get_json(stack, f"/api/jobs?limit=2{cursor}")
        assert len(page["jobs"]) <= 2
        seen += [j["job_id"] for j in page["jobs"]]
        if page["next_cursor"] is None:
            break
        cursor = f"&cursor={page['next_cursor']}"
    assert seen == newest_first

    def ids(query: str) -> list[str]:
        return [j["job_id"] for j in get_json(stack, f"/api/jobs?{query}")["jobs"]]

    assert ids("name_prefix=sweep-") == list(reversed(sweep))
    assert ids("user=bob") == [other]
    assert ids("state=failed") == [other]
    assert ids(f"parent={sweep[0]}") == [child]
    assert ids("user=ada&state=succeeded&limit=3") == [child, sweep[4], sweep[3]]
    summary = get_json(stack, "/api/jobs?user=bob")["jobs"][0]
    assert summary["task_counts"] == {"failed": 1} and "exited with code 1" in summary["error"]

    # The page's state filter offers what /api/states lists (test_browser checks the page):
    # each is accepted, and a task-only state is refused by name.
    names = get_json(stack, "/api/states")
    assert names["job"] == ["pending", "running", "succeeded", "failed", "killed",
                            "unschedulable"]
    assert set(names["job_terminal"]) < set(names["job"]) <= set(names["task"])
    assert all(httpx.get(f"{stack.api_url}/api/jobs?state={s}", timeout=10).status_code == 200
               for s in names["job"])
    for task_only in set(names["task"]) - set(names["job"]):
        resp = httpx.get(f"{stack.api_url}/api/jobs?state={task_only}", timeout=10)
        assert resp.status_code == 400 and "state" in resp.text, (task_only, resp.text)

    for query, field in [("state=bogus", "state"), ("cursor=abc", "cursor"),
                         ("limit=0", "limit"), ("limit=5000", "limit")]:
        resp = httpx.get(f"{stack.api_url}/api/jobs?{query}", timeout=10)
        assert resp.status_code == 400, query
        assert field in resp.text, (query, resp.text)
    assert httpx.get(f"{stack.api_url}/api/jobs?parent=j99-abcd").status_code == 404


async def test_task_and_worker_detail_and_unknown_ids_are_404(make_stack: Any, nc: NATS
                                                              ) -> None:
    stack: Stack = make_stack(workers=1)
    job_id = await accepted(nc, spec("pair", replicas=2, command=["sh", "-c", "exit 3"]))
    await wait_for_job(stack, job_id, {"failed"})
    t = get_json(stack, f"/api/jobs/{job_id}/tasks/1")
    assert t["job_id"] == job_id and t["index"] == 1 and t["job_state"] == "failed"
    assert t["state"] in ("failed", "killed")
    assert t["current_attempt"] == t["attempts"][-1]["attempt_id"]
    failed = get_json(stack, f"/api/jobs/{job_id}/tasks/0")
    if failed["state"] != "failed":
        failed = t
    assert failed["exit_code"] == 3 and "exited with code 3" in failed["error"]

    # The job ends when one task fails; the other's kill is confirmed a little later (and
    # the worker is healthy once the dashboard has heard its heartbeat).
    worker = await wait_until(lambda: (w := get_json(stack, "/api/workers/local-0"))
                              ["cpu_free"] == 2.0 and w["healthy"] and w,
                              what="the kill confirmed, the worker heard")
    assert worker["resources"]["cpu"] == 2.0 and worker["running_attempts"] == []
    assert worker["last_heartbeat"] is not None

    # The host timeline: one row for the one host, a bar for each task's attempt, ended.
    tl = get_json(stack, f"/api/timeline?since={t['attempts'][0]['assigned_at'] - 1}")
    assert [r["worker_id"] for r in tl["hosts"]] == ["local-0"] and tl["total_hosts"] == 1
    bars = tl["hosts"][0]["bars"]
    assert sorted((b["job_id"], b["task_index"], b["attempt_id"]) for b in bars) == [
        (job_id, 0, 0), (job_id, 1, 0)]
    assert all(b["end"] is not None and b["end"] >= b["start"] and b["group"] == ""
               for b in bars)
    assert {b["state"] for b in bars} <= {"failed", "killed"}
    assert tl["hosts"][0]["overlaps"] == [] and tl["next_cursor"] is None
    assert tl["cluster"] and tl["cluster"][-1]["hosts_busy"] == 0  # as it stands
    assert get_json(stack, "/api/timeline?hosts=nope")["hosts"] == []
    for query, field in [("since=10&until=5", "since"), ("until=nan", "until"),
                         ("limit=0", "limit"), ("since=abc", "since")]:
        resp = httpx.get(f"{stack.api_url}/api/timeline?{query}", timeout=10)
        assert resp.status_code == 400 and field in resp.json()["detail"], (query, resp.text)

    for path in (f"/api/jobs/{job_id}/tasks/2", f"/api/jobs/{job_id}/tasks/0/logs?attempt=9",
                 "/api/workers/nope", "/api/jobs/j9-abcd/tasks/0", "/api/nothing"):
        resp = httpx.get(stack.api_url + path, timeout=10)
        assert resp.status_code == 404, path
        assert resp.json()["detail"], path


PRINT_SLOWLY = "import sys, time\nfor i in range(6):\n    print('line', i, flush=True)\n" \
               "    time.sleep(0.3)\n"


async def test_logs_tail_and_follow_until_the_attempt_exits(make_stack: Any, nc: NATS
                                                            ) -> None:
    stack: Stack = make_stack(workers=1)
    job_id = await accepted(nc, spec("talker", command=["python3", "-c", PRINT_SLOWLY]))
    await wait_until(lambda: get_json(stack, f"/api/jobs/{job_id}")["state"] == "running",
                     what="the job running")
    path = f"{stack.api_url}/api/jobs/{job_id}/tasks/0/logs"
    async with httpx.AsyncClient(timeout=30) as client, \
            client.stream("GET", path, params={"follow": "true"}) as resp:
        assert resp.status_code == 200
        followed = "".join([chunk async for chunk in resp.aiter_text()])
    # The stream ended by itself, after the last line, once the attempt had exited.
    assert followed.splitlines() == [f"line {i}" for i in range(6)]
    assert get_json(stack, f"/api/jobs/{job_id}")["tasks"][0]["attempts"][0]["exited"]
    tail = httpx.get(path, params={"tail": 2}, timeout=10).text
    assert tail.splitlines() == ["line 4", "line 5"]


async def read_sse(client: httpx.AsyncClient, url: str, count: int,
                   headers: dict[str, str] | None = None) -> list[tuple[int, dict[str, Any]]]:
    """The first `count` events of an SSE stream, as (id, data)."""
    events: list[tuple[int, dict[str, Any]]] = []
    event_id: int | None = None
    async with client.stream("GET", url, headers=headers or {}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        async for line in resp.aiter_lines():
            if line.startswith("id: "):
                event_id = int(line[4:])
            elif line.startswith("data: "):
                assert event_id is not None
                events.append((event_id, json.loads(line[6:])))
                if len(events) == count:
                    return events
    raise AssertionError(f"the stream ended after {len(events)} events")


async def test_sse_ids_are_stream_sequences_and_last_event_id_resumes(
        make_stack: Any, nc: NATS) -> None:
    stack: Stack = make_stack(workers=1, extra_env={"BERTH_SNAPSHOT_INTERVAL": "0.5"})
    first = await accepted(nc, spec("first"))
    await wait_for_job(stack, first, {"succeeded"})
    last = await nats_io.last_event_seq(nc.jetstream())
    url = f"{stack.api_url}/api/events"
    async with httpx.AsyncClient(timeout=30) as client:
        everything = await read_sse(client, url + "?after=0", last)
        assert [seq for seq, _ in everything] == list(range(1, last + 1))
        kinds = [data["type"] for _, data in everything]
        assert "job_submitted" in kinds and "attempt_reported" in kinds
        # A client that reconnects with Last-Event-ID gets exactly what came after it.
        resumed = await read_sse(client, url, last - 3, headers={"Last-Event-ID": "3"})
        assert resumed == everything[3:]

        # Live: the events of a job submitted while the stream is open arrive in order.
        import asyncio

        watching = asyncio.create_task(read_sse(client, url, 3))
        await asyncio.sleep(0.5)
        second = await accepted(nc, spec("second"))
        live = await watching
        assert [seq for seq, _ in live] == list(range(last + 1, last + 4))
        assert live[0][1]["type"] == "job_submitted" and live[0][1]["job_id"] == second

        # After a restart the dashboard serves old ids from the stream itself.
        stack.stop_child("dashboard")
        stack.start_service("dashboard")
        from berth.stack import wait_for_api

        wait_for_api(stack)
        assert await read_sse(client, url, last - 1, headers={"Last-Event-ID": "1"}) \
            == everything[1:]
        bad = await client.get(url, headers={"Last-Event-ID": "soon"})
        assert bad.status_code == 400 and "Last-Event-ID" in bad.text


async def test_submit_and_cancel_need_the_token(make_stack: Any) -> None:
    stack: Stack = make_stack(workers=1)
    url = f"{stack.api_url}/api/jobs"
    job = {"name": "via-http", "command": ["sleep", "30"],
           "resources": {"cpu": 0.5, "memory_mb": 64}}
    no_token = httpx.post(url, json=job, timeout=10)
    assert no_token.status_code == 401 and "bearer token" in no_token.json()["detail"]
    assert no_token.headers["www-authenticate"].startswith("Bearer")
    wrong = httpx.post(url, json=job, headers=bearer(stack, "guess"), timeout=10)
    assert wrong.status_code == 401

    created = httpx.post(url, json=job, headers=bearer(stack), timeout=20)
    assert created.status_code == 201, created.text
    job_id = created.json()["job_id"]
    assert get_json(stack, created.json()["outcome"])["job_id"] == job_id
    await wait_until(lambda: get_json(stack, f"/api/jobs/{job_id}")["state"] == "running",
                     what="the job running")

    # Bad input: Litestar names the field; the submitter's own checks come back as 400s.
    bad = httpx.post(url, json={**job, "replicas": "two"}, headers=bearer(stack), timeout=10)
    assert bad.status_code == 400 and "replicas" in bad.text
    unknown_field = httpx.post(url, json={**job, "gpus": 8}, headers=bearer(stack), timeout=10)
    assert unknown_field.status_code == 400 and "gpus" in unknown_field.text
    orphan = httpx.post(url, json={**job, "parent": "j999-abcd"}, headers=bearer(stack),
                        timeout=20)
    assert orphan.status_code == 400 and "parent: no job 'j999-abcd'" in orphan.text
    # An Idempotency-Key makes a retried request the same submission.
    key = {**bearer(stack), "Idempotency-Key": "req-7"}
    once = httpx.post(url, json={**job, "command": ["true"]}, headers=key, timeout=20).json()
    twice = httpx.post(url, json={**job, "command": ["true"]}, headers=key, timeout=20).json()
    assert once["job_id"] == twice["job_id"]

    cancel = f"{url}/{job_id}/cancel"
    assert httpx.post(cancel, timeout=10).status_code == 401
    assert httpx.post(cancel, headers=bearer(stack), timeout=10).status_code == 202
    await wait_for_job(stack, job_id, {"killed"})


async def test_reads_can_be_closed_with_the_same_token(make_stack: Any) -> None:
    stack: Stack = make_stack(workers=0, extra_env={"BERTH_API_CLOSED_READS": "1"})
    # Metrics tell as much about the cluster as the reads do (docs/metrics.md).
    for path in ("/api/jobs", "/api/workers", "/api/events", "/metrics"):
        resp = httpx.get(stack.api_url + path, timeout=10)
        assert resp.status_code == 401, path
    for path in ("/api/jobs", "/metrics"):
        assert httpx.get(stack.api_url + path, headers=bearer(stack),
                         timeout=10).status_code == 200, path
    # Liveness and the page itself stay open (the page asks for the token).
    assert httpx.get(stack.api_url + "/healthz", timeout=10).status_code == 200
    assert httpx.get(stack.api_url + "/", timeout=10).status_code == 200


async def test_a_job_just_accepted_is_found_at_once(make_stack, nc: NATS) -> None:
    """A client told of its job by the stream (the submit's outcome) and asking the API at
    once: the dashboard folds at its own pace, and said 404 until it had caught up. Here it
    is held (SIGSTOP) while the jobs are accepted, so each read comes before its fold."""
    stack: Stack = make_stack(workers=0)
    await wait_for_job(stack, await accepted(nc, spec("first")), {"pending"})
    dashboard = stack.children["dashboard"]
    dashboard.send_signal(signal.SIGSTOP)
    try:
        job_ids = [await accepted(nc, spec(f"at-once{i}")) for i in range(3)]
    finally:
        dashboard.send_signal(signal.SIGCONT)
    async with httpx.AsyncClient(base_url=stack.api_url, timeout=10) as http:
        replies = await asyncio.gather(*(http.get(f"/api/jobs/{job_id}/tasks/0")
                                         for job_id in job_ids))
    assert [r.status_code for r in replies] == [200] * 3, [r.text for r in replies]
    assert all(r.json()["state"] == "pending" for r in replies)
    # A well-formed id of no job still says so, after its bounded wait.
    missing = httpx.get(f"{stack.api_url}/api/jobs/j999999-0000", timeout=10)
    assert missing.status_code == 404 and "no job 'j999999-0000'" in missing.text
