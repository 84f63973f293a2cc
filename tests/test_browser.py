"""The web dashboard in headless Chromium (Debian's `chromium`, driven by Playwright): a job
submitted from the page, its worker SIGKILLed mid-run, and the page following it to
succeeded without a reload, with the attempt history marking the worker failure; then the
host timeline drawing those two attempts, and a known set of attempts (gangs, shared hosts,
an overlap) checked bar by bar and pixel by pixel in a screenshot."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from berth.stack import Stack
from tests.conftest import get_json, wait_until
from tests.test_api_auth import mint

CHROMIUM = os.environ.get("BERTH_CHROMIUM", "/usr/bin/chromium")
# As the machine notes say: no sandbox as root, and no background networking on a closed
# network.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]

# Attempt 0 runs until its worker is killed; the retry finishes at once.
SCRIPT = "echo attempt $BERTH_ATTEMPT_ID; [ $BERTH_ATTEMPT_ID = 0 ] && exec sleep 120; exit 0"
SPEC = json.dumps({"name": "browser-demo", "command": ["sh", "-c", SCRIPT],
                   "resources": {"cpu": 0.5, "memory_mb": 64}}, indent=2)


def chromium_or_skip() -> str:
    path = shutil.which(CHROMIUM) or (CHROMIUM if os.path.exists(CHROMIUM) else None)
    if path is None:
        if os.environ.get("BERTH_REQUIRE_BROWSER") == "1":
            pytest.fail(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
        pytest.skip(f"no Chromium at {CHROMIUM}; .ci/run installs it")
    return path


@contextlib.asynccontextmanager
async def explained(page: Any) -> AsyncIterator[None]:
    """A wait that times out says what the page showed then: its main part, the live
    indicator and its console (a rare timeout is otherwise a bare 'Timeout exceeded')."""
    from playwright.async_api import TimeoutError as PlaywrightTimeout

    console: list[str] = []
    page.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
    page.on("requestfailed", lambda request: console.append(f"failed: {request.url}"))
    try:
        yield
    except PlaywrightTimeout as exc:
        shown = await page.evaluate("""() => ({
          main: document.getElementById("main")?.innerHTML.slice(0, 3000),
          live: document.getElementById("live")?.textContent,
          url: location.href})""")
        raise AssertionError(f"{exc}\npage: {shown}\nconsole: {console[-30:]}") from exc


async def open_the_submit_box(page: Any) -> None:
    """Click the submit box's summary until the box is open, as a user would.

    A live update that changes the page redraws it; one landing between the press and the
    release of a click loses that click (the page skips redraws that change nothing)."""
    from playwright.async_api import TimeoutError as PlaywrightTimeout

    for _ in range(3):
        await page.click("#submit-box summary")
        try:
            await page.wait_for_selector("#submit-box[open] #spec", timeout=3_000)
            return
        except PlaywrightTimeout:
            continue
    raise AssertionError("the submit box did not open after 3 clicks")


async def test_submit_from_the_page_and_watch_it_succeed_without_reload(
        make_stack: Any, tmp_path: Path) -> None:
    chromium = chromium_or_skip()
    from playwright.async_api import async_playwright

    stack: Stack = make_stack(workers=2)
    await wait_until(lambda: len(get_json(stack, "/api/workers")) == 2, what="2 workers")
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 900})
            async with explained(page):
                await submit_and_follow_a_failover(page, stack, tmp_path)
            await check_a_known_timeline(await browser.new_page(
                viewport={"width": 1400, "height": 900}), stack, tmp_path)
        finally:
            await browser.close()


async def submit_and_follow_a_failover(page: Any, stack: Stack, tmp_path: Path) -> None:
    await page.goto(stack.api_url + "/")
    await page.wait_for_selector("#live.on")  # the event stream is open
    # The state filter offers exactly the states the API's filter accepts.
    await page.wait_for_selector("select[name=state] option", state="attached")
    offered = await page.eval_on_selector_all(
        "select[name=state] option", "els => els.map((e) => e.value)")
    assert offered == ["", *get_json(stack, "/api/states")["job"]]
    await page.evaluate("window.__sameDocument = true")
    await page.fill("#token", stack.api_token)
    await page.dispatch_event("#token", "change")

    await open_the_submit_box(page)
    await page.fill("#spec", SPEC)
    await page.click("#submit")
    link = page.locator("#submit-result a")
    await link.wait_for()
    job_id = (await link.inner_text()).strip()
    # The new job shows up in the list by itself.
    await page.wait_for_selector(f'tr[data-job="{job_id}"]')
    await link.click()
    await page.wait_for_selector("#job-state [data-state=running]")
    await page.screenshot(path=str(tmp_path / "running.png"), full_page=True)

    # Kill the worker running attempt 0: the page follows the failover live.
    job = get_json(stack, f"/api/jobs/{job_id}")
    victim = job["tasks"][0]["attempts"][0]["worker_id"]
    stack.children.pop(victim).send_signal(signal.SIGKILL)
    await page.wait_for_selector("#job-state [data-state=succeeded]", timeout=40_000)

    assert await page.evaluate("window.__sameDocument") is True, "the page reloaded"
    first = page.locator('tr.attempt[data-attempt="0"]')
    assert "(worker failure)" in await first.inner_text()
    assert await first.locator("[data-state=worker_failed]").count() == 1
    second = page.locator('tr.attempt[data-attempt="1"]')
    assert await second.locator("[data-state=succeeded]").count() == 1
    # The seed's colours.
    colour = await page.eval_on_selector(
        "#job-state .badge", "el => getComputedStyle(el).backgroundColor")
    assert colour == "rgb(26, 127, 55)"  # succeeded green #1a7f37
    assert await first.locator(".badge").evaluate(
        "el => getComputedStyle(el).backgroundColor") == "rgb(130, 80, 223)"

    await page.click('a[data-logs="0/1"]')
    await page.wait_for_function(
        "document.getElementById('logs')?.textContent.includes('attempt 1')")
    shot = tmp_path / "dashboard.png"
    await page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000

    await page.click("[data-nav=workers]")
    await page.wait_for_selector(f'tr[data-worker="{victim}"] .error')  # dead
    await page.screenshot(path=str(tmp_path / "workers.png"), full_page=True)
    await page.click("[data-nav=schedules]")
    await page.wait_for_selector("#schedules")  # drawn from /api/schedules (none here)
    assert await page.evaluate("window.__sameDocument") is True

    await check_the_timeline_of_the_job(page, stack, job_id, victim, tmp_path)


async def test_the_page_asks_for_a_token_where_reads_are_closed(make_stack: Any) -> None:
    chromium = chromium_or_skip()
    from playwright.async_api import async_playwright

    stack: Stack = make_stack(workers=0, extra_env={"BERTH_API_CLOSED_READS": "1"})
    rita = mint(stack, "rita", "read")
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            async with explained(page):
                await page.goto(stack.api_url + "/")
                error = page.locator("#main .error")
                await error.wait_for()
                assert "reads are closed" in await error.inner_text()
                assert "enter an API token" in await error.inner_text()
                await page.wait_for_selector("#live.off:has-text('token needed')")

                # A read token opens the page and its live stream; actions stay refused.
                await page.fill("#token", rita)
                await page.dispatch_event("#token", "change")
                await page.wait_for_selector("#jobs")
                await page.wait_for_selector("#live.on")
                await open_the_submit_box(page)
                await page.click("#submit")
                refused = page.locator("#submit-result .error")
                await refused.wait_for()
                assert "'rita' has role read" in await refused.inner_text()
        finally:
            await browser.close()


# --- the host timeline ---------------------------------------------------------------------


async def bars_by_row(page: Any) -> dict[str, list[dict[str, Any]]]:
    """Each host row's bars as drawn: data attributes, and the body's box and fill."""
    rows: dict[str, list[dict[str, Any]]] = await page.evaluate("""() => {
      const out = {};
      for (const row of document.querySelectorAll("#timeline-hosts .host-row")) {
        out[row.dataset.worker] = [...row.querySelectorAll(".bar")].map((g) => {
          const body = g.querySelector(".bar-body");
          const box = body.getBoundingClientRect();
          return { ...g.dataset, x: box.x, y: box.y, w: box.width, h: box.height,
                   fill: getComputedStyle(body).fill, stroke: getComputedStyle(body).stroke,
                   rowTop: row.getBoundingClientRect().y,
                   rowBottom: row.getBoundingClientRect().bottom };
        });
      }
      return out;
    }""")
    return rows


def assert_no_overlap_within_a_lane(rows: dict[str, list[dict[str, Any]]]) -> None:
    for worker, bars in rows.items():
        for bar in bars:  # inside its own row
            assert bar["rowTop"] <= bar["y"] and bar["y"] + bar["h"] <= bar["rowBottom"], bar
        for i, a in enumerate(bars):
            for b in bars[i + 1:]:
                apart = a["x"] + a["w"] <= b["x"] + 0.5 or b["x"] + b["w"] <= a["x"] + 0.5
                assert a["lane"] != b["lane"] or apart, (worker, a, b)
                # Bars of different lanes never share a pixel row either.
                if a["lane"] != b["lane"]:
                    assert a["y"] + a["h"] <= b["y"] or b["y"] + b["h"] <= a["y"], (a, b)


async def screenshot_pixels(page: Any, path: Path) -> Any:
    """Takes a screenshot to `path` and returns a function reading its pixels: the PNG
    itself decoded by the browser, so what is checked is what was captured."""
    png = await page.screenshot(path=str(path))
    assert len(png) > 10_000  # a page drawn, not a blank
    await page.evaluate("""async (b64) => {
      const img = new Image();
      img.src = "data:image/png;base64," + b64;
      await img.decode();
      const canvas = document.createElement("canvas");
      canvas.width = img.width; canvas.height = img.height;
      const ctx = canvas.getContext("2d");
      ctx.drawImage(img, 0, 0);
      window.__shot = ctx;
    }""", base64.b64encode(png).decode())

    async def pixel(x: float, y: float) -> str:
        rgb: list[int] = await page.evaluate(
            "([x, y]) => [...window.__shot.getImageData(x, y, 1, 1).data].slice(0, 3)",
            [round(x), round(y)])
        return f"rgb({rgb[0]}, {rgb[1]}, {rgb[2]})"
    return pixel


async def check_the_timeline_of_the_job(page: Any, stack: Stack, job_id: str, victim: str,
                                        tmp_path: Path) -> None:
    """The job's two attempts, one bar each, on the hosts that ran them, in a window that
    ends just after the job did."""
    job = get_json(stack, f"/api/jobs/{job_id}")
    until = job["finished_at"] + 2
    since = job["submitted_at"] - 2
    api = get_json(stack, f"/api/timeline?since={since}&until={until}")
    drawn_by_api = {(b["job_id"], b["attempt_id"], row["worker_id"])
                    for row in api["hosts"] for b in row["bars"]}
    assert {(j, a) for j, a, _ in drawn_by_api} == {(job_id, 0), (job_id, 1)}
    assert all(not row["overlaps"] for row in api["hosts"])
    # The cluster chart's samples saw the first attempt run on its host (one is taken
    # within a second of a change, however quiet the log is after it).
    assert any(p["running"] == 1 and p["hosts_busy"] == 1 for p in api["cluster"]), api

    await page.click("[data-nav=timeline]")
    await page.wait_for_selector("#timeline-hosts")
    await page.evaluate(f"go('/timeline?until={until}&window={until - since}')")
    # The window asked for, not the default one drawn a moment before.
    await page.wait_for_function(
        "(until) => Math.abs(Number(document.getElementById('timeline-hosts')"
        "?.dataset.until) - until) < 0.01", arg=until)
    assert await page.locator("#timeline-hosts .bar").count() == 2
    assert await page.evaluate("window.__sameDocument") is True
    rows = await bars_by_row(page)
    drawn = {(b["job"], int(b["attempt"]), w) for w, bars in rows.items() for b in bars}
    assert drawn == drawn_by_api, (rows, api)
    assert [b["state"] for b in rows[victim]] == ["worker_failed"], (rows, api)
    assert_no_overlap_within_a_lane(rows)
    first = rows[victim][0]
    assert first["w"] > 20  # ran seconds of a window of about 10
    pixel = await screenshot_pixels(page, tmp_path / "timeline-job.png")
    assert await pixel(first["x"] + first["w"] / 3, first["y"] + first["h"] / 2) \
        == first["fill"]
    # The end is drawn in its state's colour: worker_failed purple, as its badge.
    assert await pixel(first["x"] + first["w"] - 2, first["y"] + first["h"] / 2) \
        == "rgb(130, 80, 223)"


def known_timeline() -> dict[str, Any]:
    def bar(job: str, attempt: int, start: float, end: float | None, state: str,
            group: str = "") -> dict[str, Any]:
        return {"job_id": job, "task_index": 0, "attempt_id": attempt, "group": group,
                "exclusive": bool(group), "start": start, "started": start, "end": end,
                "state": state}

    def row(worker: str, bars: list[dict[str, Any]], overlaps: tuple[str, ...] = ()
            ) -> dict[str, Any]:
        return {"worker_id": worker, "host": "h", "alive": True, "bars": bars,
                "overlaps": list(overlaps), "truncated": False}

    def point(ts: float, pending: int, assigned: int, running: int, busy: int
              ) -> dict[str, Any]:
        return {"ts": ts, "pending": pending, "assigned": assigned, "running": running,
                "hosts_busy": busy, "hosts_up": 3}

    return {"since": 1000.0, "until": 1100.0, "total_hosts": 3, "next_cursor": None,
            "truncated": False,
            "hosts": [
                # Two tasks of no gang sharing a host: two lanes.
                row("w-shared", [bar("j1-aaaa", 0, 1000, 1050, "succeeded"),
                                 bar("j2-bbbb", 0, 1020, 1080, "failed"),
                                 bar("j1-aaaa", 1, 1060, 1090, "succeeded")]),
                row("w-gang", [bar("j3-cccc", 0, 1010, None, "running", "rack=r1")]),
                # What must never happen, drawn as it would be: marked.
                row("w-bad", [bar("j4-dddd", 0, 1000, 1060, "killed", "rack=r2"),
                              bar("j5-eeee", 0, 1030, 1090, "running", "rack=r2")],
                    ("j4-dddd/0#0 and j5-eeee/0#0",)),
            ],
            "cluster": [point(1000, 3, 0, 0, 0), point(1010, 1, 1, 1, 2),
                        point(1060, 0, 0, 3, 3)]}


async def check_a_known_timeline(page: Any, stack: Stack, tmp_path: Path) -> None:
    """The drawing of a known answer: a bar per attempt, overlapping attempts of a shared
    host in separate lanes, gangs outlined, an overlap of gangs marked, each bar's colour
    exactly over its time range in the screenshot."""
    body = json.dumps(known_timeline())

    async def answer(route: Any) -> None:
        await route.fulfill(status=200, content_type="application/json", body=body)

    await page.route("**/api/timeline?*", answer)
    await page.goto(stack.api_url + "/timeline?until=1100&window=100")
    await page.wait_for_selector("#timeline-hosts .bar >> nth=5", state="attached")
    rows = await bars_by_row(page)
    assert {w: len(b) for w, b in rows.items()} == {"w-shared": 3, "w-gang": 1, "w-bad": 2}
    assert_no_overlap_within_a_lane(rows)
    shared = rows["w-shared"]
    assert [b["lane"] for b in shared] == ["0", "1", "0"]  # the retry reuses the free lane
    assert shared[0]["fill"] == shared[2]["fill"] != shared[1]["fill"]  # a job's colour
    assert rows["w-gang"][0]["stroke"] != "none" and shared[0]["stroke"] == "none"
    assert await page.locator('.host-row.overlap[data-worker="w-bad"]').count() == 1
    assert await page.locator(".host-row.overlap").count() == 1
    assert "j4-dddd/0#0 and j5-eeee/0#0" in await page.locator("#overlaps").inner_text()
    assert await page.locator("#cluster-chart path.series").count() == 4

    # In the screenshot, a bar's colour lies exactly over its time: j1's first attempt
    # (1000-1050) at 1025, not at 1055 in its lane (free then), j1's retry at 1075.
    a, retry = shared[0], shared[2]
    per_second = a["w"] / 50
    middle = a["y"] + a["h"] / 2
    pixel = await screenshot_pixels(page, tmp_path / "timeline-known.png")
    assert await pixel(a["x"] + 25 * per_second, middle) == a["fill"]
    assert await pixel(a["x"] + 55 * per_second, middle) != a["fill"]
    assert await pixel(a["x"] + 75 * per_second, middle) == retry["fill"]
    assert abs(retry["x"] - (a["x"] + 60 * per_second)) < 1.5

    # A bar leads to its job.
    await page.click('.bar[data-job="j3-cccc"]')
    await page.wait_for_url("**/jobs/j3-cccc")
