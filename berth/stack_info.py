"""`stack.json`: what a running `berth up` tells the `berth` commands beside it (its URLs,
its servers' pids, its auth folder). Written by berth/stack.py; read only here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from berth.shared import config

STACK_INFO = "stack.json"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def read_stack_info(data_dir: str | Path) -> dict[str, Any]:
    """The running stack's info, or {} when none runs in `data_dir` (or it is unreadable)."""
    try:
        info = json.loads((Path(data_dir) / STACK_INFO).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def nats_url(flag: str | None, data_dir: str | Path) -> str:
    """The NATS URL(s) a command uses: its flag, then BERTH_NATS_URL, then a running
    `berth up`'s."""
    return (flag or config.cli_nats_url()
            or str(read_stack_info(data_dir).get("nats_url", DEFAULT_NATS_URL)))
