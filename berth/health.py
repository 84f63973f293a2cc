"""`berth health`: one verdict per service from what can already be read (the scheduler's
lease in Redis, the dashboard's /healthz, the workers' heartbeats in the API, `berth up`'s
stack.json). Pure: berth/cli.py gathers, these judge."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Verdict:
    service: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{self.service:<18} {'ok' if self.ok else 'FAIL':<5} {self.detail}"


def scheduler(lease: str | None, ttl_ms: int) -> Verdict:
    """From Redis' leader key ("scheduler_id:epoch", shared/redis_keys.LEADER) and its TTL."""
    if not lease or ttl_ms <= 0:
        return Verdict("scheduler", False, "no scheduler holds the leader lease")
    holder, _, epoch = lease.rpartition(":")
    return Verdict("scheduler", True, f"{holder} leads, epoch {epoch} "
                   f"(lease renewed, {ttl_ms / 1000:.1f}s left)")


def dashboard(status: int | None, body: Any, why: str = "") -> Verdict:
    """From GET /healthz: its status code (None: no answer) and JSON body."""
    if status is None or not isinstance(body, dict):
        return Verdict("dashboard", False, f"no answer ({why})" if why else "no answer")
    if status == 200 and body.get("caught_up"):
        return Verdict("dashboard", True, f"caught up (event {body.get('events_seq')})")
    return Verdict("dashboard", False, f"catching up with the log (folded to event "
                   f"{body.get('events_seq')}, HTTP {status})")


def workers(listed: list[dict[str, Any]], now: float) -> list[Verdict]:
    """From GET /api/workers: each worker's `healthy` (heartbeating, per the dashboard) and
    the age of its last heartbeat."""
    verdicts = []
    for w in listed:
        name = f"worker {w['worker_id']}"
        beat = w.get("last_heartbeat")
        age = f"last heartbeat {now - beat:.1f}s ago" if beat else "no heartbeat yet"
        verdicts.append(Verdict(name, bool(w.get("healthy")), age if w.get("healthy")
                                else f"not heartbeating ({age})"))
    return verdicts or [Verdict("workers", False, "none registered")]


def children(info: dict[str, Any]) -> Verdict | None:
    """From a running `berth up`'s stack.json: its restarts so far (never a failure: the
    stack restarts what exits; the other verdicts say whether it came back)."""
    kids = info.get("children")
    if not isinstance(kids, dict):
        return None
    restarted = {label: c["restarts"] for label, c in sorted(kids.items())
                 if isinstance(c, dict) and c.get("restarts")}
    detail = f"{len(kids)} processes (pid {info.get('pid')})"
    if restarted:
        detail += "; restarts: " + ", ".join(f"{label} {n}" for label, n in restarted.items())
    return Verdict("berth up", True, detail)
