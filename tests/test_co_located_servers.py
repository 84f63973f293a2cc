"""The nats-server a stack starts beside berth's services runs with GOMAXPROCS capped, so
Go's idle threads do not spin on the cores the services need (shared/config.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from berth.shared import servers
from berth.shared.config import co_located_go_procs


@pytest.mark.parametrize(("environ", "cpus", "expected"), [
    ({}, 1, "1"),
    ({}, 2, "1"),
    ({}, 3, "1"),
    ({}, 16, "8"),
    ({"GOMAXPROCS": ""}, 16, "8"),  # set but empty: as unset
    ({"GOMAXPROCS": "3"}, 16, "3"),  # the operator's own choice stands
    ({"GOMAXPROCS": " 12 "}, 2, "12"),
])
def test_half_the_cores_unless_the_environment_says(environ: dict[str, str], cpus: int,
                                                    expected: str) -> None:
    assert co_located_go_procs(environ, cpus) == expected


def test_by_default_it_counts_the_cores_this_process_may_use() -> None:
    assert co_located_go_procs({}) == str(max(1, len(os.sched_getaffinity(0)) // 2))


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if item)


@pytest.mark.parametrize("own", [None, "5"])
def test_the_started_nats_server_gets_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         own: str | None) -> None:
    if own is None:
        monkeypatch.delenv("GOMAXPROCS", raising=False)
    else:
        monkeypatch.setenv("GOMAXPROCS", own)
    nats = servers.start_nats(tmp_path)
    try:
        environ = _environ_of(nats.proc.pid)
    finally:
        nats.stop()
    assert environ["GOMAXPROCS"] == (own or co_located_go_procs({}))
    # The rest of the environment is passed on as before.
    assert environ.get("PATH") == os.environ.get("PATH")
