"""The metrics module on its own (docs/metrics.md): the settings, the gauges read off a
fold, and the endpoint over real HTTP. Every service's endpoint on a real stack is scraped
in tests/test_end_to_end.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from berth.shared import metrics, servers
from berth.shared.config import Settings
from berth.shared.messages import DeviceStats, Priority
from tests.test_lifecycle import fold, registered, submitted


def test_metrics_are_off_and_on_the_loopback_by_default(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.delenv("BERTH_METRICS_PORT", raising=False)
    monkeypatch.delenv("BERTH_METRICS_HOST", raising=False)
    settings = Settings.from_env()
    assert (settings.metrics_host, settings.metrics_port) == ("127.0.0.1", 0)


@pytest.mark.parametrize(("raw", "said"), [
    ("ninety", "BERTH_METRICS_PORT='ninety' is not an integer"),
    ("70000", "BERTH_METRICS_PORT=70000 is not a port (1-65535; 0 or unset: off)"),
])
def test_a_bad_metrics_port_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch, raw: str,
                                                  said: str) -> None:
    monkeypatch.setenv("BERTH_METRICS_PORT", raw)
    with pytest.raises(SystemExit) as exc:
        Settings.from_env()
    assert str(exc.value) == said


def test_fold_gauges_count_pending_by_band_and_workers_by_state() -> None:
    state, _ = fold([registered("w1"), registered("w2", "i2"),
                     submitted("j1", replicas=2), submitted("j2", priority=Priority.PRODUCTION)])
    assert metrics.pending_by_band(state) == {"production": 1, "interactive": 2, "batch": 0}
    assert metrics.workers_by_state(state) == {"in_service": 2, "cordoned": 0, "draining": 0,
                                               "quarantined": 0, "dead": 0}
    samples = {(s.name, tuple(s.labels.values())): s.value
               for family in metrics.state_metrics(state, stream_last_seq=10)
               for s in family.samples}
    assert samples[("berth_fold_seq", ())] == 4
    assert samples[("berth_fold_lag", ())] == 6
    assert samples[("berth_pending_tasks", ("interactive",))] == 2


def test_gpu_gauges_hold_only_what_a_device_reported() -> None:
    families = {f.name: f for f in metrics.device_metrics({"w1": [
        DeviceStats(index=0, utilization=87, memory_used_mb=1024, temperature_c=61),
        DeviceStats(index=1)]})}
    [mem] = families["berth_gpu_memory_used_bytes"].samples
    assert (mem.labels, mem.value) == ({"worker": "w1", "gpu": "0"}, 1024 * 1024 * 1024)
    assert len(families["berth_gpu_utilization_percent"].samples) == 1


async def test_the_endpoint_answers_over_http_even_when_a_source_hangs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "REFRESH_TIMEOUT", 0.2)
    refreshed: list[str] = []

    async def hangs() -> None:
        await asyncio.sleep(60)

    async def answers() -> None:
        refreshed.append("yes")

    port = servers.free_port()
    serving = await metrics.serve("127.0.0.1", port, [hangs, answers])
    assert serving is not None
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            resp = await client.get(f"http://127.0.0.1:{port}/metrics")
            elsewhere = await client.get(f"http://127.0.0.1:{port}/")
    finally:
        await serving.stop()
    assert resp.status_code == 200 and refreshed == ["yes"]
    names = {f.name for f in text_string_to_metric_families(resp.text)}
    assert "berth_publish_retries" in names
    assert elsewhere.status_code == 404
    assert await metrics.serve("127.0.0.1", 0) is None, "port 0: off"
