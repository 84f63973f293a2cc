"""berth: a cluster job scheduler. The public Python facade is small:

    from berth import submit_job, JobSpec
    outcome = await submit_job("nats://127.0.0.1:4222", JobSpec(name="hi", command=["echo"]))

Everything else lives in `berth.shared` and `berth.services` (the folders `shared/` and
`services/` at the top of the repository; docs/decisions.md, "One namespace").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from berth.client import SubmitOutcome, submit_job, wait_for_outcome
    from berth.shared.messages import JobSpec, Resources

__all__ = ["JobSpec", "Resources", "SubmitOutcome", "submit_job", "wait_for_outcome"]

# Loaded on first use (PEP 562): every `berth` command imports this package, and the facade
# pulls in the NATS client, which `berth --help` or `berth jobs` never touches.
_HOMES = {"JobSpec": "berth.shared.messages", "Resources": "berth.shared.messages",
          "SubmitOutcome": "berth.client", "submit_job": "berth.client",
          "wait_for_outcome": "berth.client"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'berth' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
