"""The web dashboard in headless Chromium (Debian's `chromium`, driven by Playwright): a job
submitted from the page, its worker SIGKILLed mid-run, and the page following it to
succeeded without a reload, with the attempt history marking the worker failure."""

from __future__ import annotations

import json
import os
import shutil
import signal
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

            await page.click("#submit-box summary")
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
        finally:
            await browser.close()


async def test_the_page_asks_for_a_token_where_reads_are_closed(make_stack: Any) -> None:
    chromium = chromium_or_skip()
    from playwright.async_api import async_playwright

    stack: Stack = make_stack(workers=0, extra_env={"BERTH_API_CLOSED_READS": "1"})
    rita = mint(stack, "rita", "read")
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
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
            await page.click("#submit-box summary")
            await page.click("#submit")
            refused = page.locator("#submit-result .error")
            await refused.wait_for()
            assert "'rita' has role read" in await refused.inner_text()
        finally:
            await browser.close()
