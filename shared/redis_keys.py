"""Every Redis key berth uses, in one place (the arq convention)."""

from __future__ import annotations

PREFIX = "berth"

LEADER = f"{PREFIX}:leader"  # "scheduler_id:epoch", with the lease TTL
EPOCH = f"{PREFIX}:epoch"  # monotonically increasing fencing epoch


def host(worker_id: str) -> str:
    """Hash: cpu_cap, mem_cap (the worker's capacity), cpu_used, mem_used (committed)."""
    return f"{PREFIX}:host:{worker_id}"


def host_allocations(worker_id: str) -> str:
    """Hash: attempt key -> "cpu_milli,memory_mb" for every reservation held on the host."""
    return f"{PREFIX}:alloc:{worker_id}"


HOSTS = f"{PREFIX}:hosts"  # set of every worker id with a host hash
