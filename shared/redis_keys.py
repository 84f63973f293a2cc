"""Every Redis key berth uses, in one place (the arq convention)."""

from __future__ import annotations

PREFIX = "berth"

LEADER = f"{PREFIX}:leader"  # "scheduler_id:epoch", with the lease TTL
EPOCH = f"{PREFIX}:epoch"  # monotonically increasing fencing epoch


def host(worker_id: str) -> str:
    """Hash: <dim>_cap (the worker's capacity) and <dim>_used (committed) for dim in cpu
    (millicores), mem, disk (MiB), dev (devices); dev_kind; dev_ids (JSON list of its
    device indices); gang: the job whose gang holds a group this host belongs to, while it
    does; held_for: the preemptor it is held for, from the eviction (preempt.lua) until the
    preemptor is reserved there (reserve.lua) or lets go (unhold.lua)."""
    return f"{PREFIX}:host:{worker_id}"


def host_allocations(worker_id: str) -> str:
    """Hash: attempt key -> JSON {job, cpu, mem, disk, dev, ports, pk, devs, dk, group} for
    every reservation held on the host (pk: the address_ports hash its ports are in; devs:
    the device indices it holds, dk: the host_devices hash they are in; group: the group
    hash key, or "")."""
    return f"{PREFIX}:alloc:{worker_id}"


def address_ports(address: str) -> str:
    """Hash: port number -> attempt key, for every named port reserved on one host address.
    Ports belong to the address, not to a worker: several workers may share an address
    (`berth up` runs all its workers on 127.0.0.1), and a port is free only once no live
    attempt of any of them holds it."""
    return f"{PREFIX}:addrports:{address}"


def host_devices(worker_id: str) -> str:
    """Hash: device index -> attempt key, for every device of the host a live attempt
    holds (the per-host counterpart of address_ports)."""
    return f"{PREFIX}:hostdevs:{worker_id}"


def group(name: str) -> str:
    """Hash: owner (job id), name, members (JSON list of host hash keys), exclusive ("1"/"0"),
    live (reservations holding it). Deleted with its last reservation."""
    return f"{PREFIX}:group:{name}"


GROUPS = f"{PREFIX}:groups"  # set of the group hash keys currently held


HOSTS = f"{PREFIX}:hosts"  # set of every worker id with a host hash

METRICS = f"{PREFIX}:metrics"  # hash of counters, e.g. refused_double_bookings

# Quotas and token limits (shared/limits.py), written by the leader from the log's admin
# events (set_limits.lua): "seq" their version, "qd" the default quota and "q:<user>" each
# user's own (JSON {cpu, mem, dev}, a dimension left out is not limited), "t:<name>" each
# token's limit.
LIMITS = f"{PREFIX}:limits"
# What live reservations hold against those limits, kept by reserve.lua and release.lua:
# "<cpu|mem|dev>:<user>" and "t:<name>" -> amount.
LIMITS_USED = f"{PREFIX}:limits_used"
# The events-stream sequence through which the leader has written every release its fold
# owes (release.lua, fenced; it only rises). A reservation of an attempt the log ended
# after it is a release still owed by a leader behind the log; one ended at or before it
# is a leak (shared/checker.py).
RELEASED_THROUGH = f"{PREFIX}:released_through"
