"""A garbage collection long enough to make a lease renewal late is logged, with its
generation (shared/service.py, `tune_gc`): the warning that says why a leader's renewal
ran late, which before had no visible cause."""

from __future__ import annotations

import gc
import logging

import pytest

from berth.shared import service


def test_a_slow_collection_is_logged_and_a_quick_one_is_not(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.WARNING, logger="berth.gc")
    monkeypatch.setattr(service, "SLOW_COLLECTION", 3600.0)
    gc.callbacks.append(service._time_collections)
    try:
        gc.collect()
        assert not caplog.records
        monkeypatch.setattr(service, "SLOW_COLLECTION", 0.0)  # every collection is slow
        gc.collect()
    finally:
        gc.callbacks.remove(service._time_collections)
    messages = [r.getMessage() for r in caplog.records]
    assert messages and all("garbage collection of generation 2 held the process" in m
                            for m in messages), messages
