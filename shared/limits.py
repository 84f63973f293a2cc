"""Per-user quotas and named tokens: whether a unit of work may be admitted against the
cluster-wide limits, and the use it then holds. Pure functions over plain data; the same
rule is enforced atomically in the placement commit (shared/lua/reserve.lua), and the
checker proves no admission ever went over (shared/checker.py).

A unit is one task, or a whole gang (`count` tasks at once: admitted whole or not at all).
Lowering a limit below what is in use stops nothing: running work keeps running, and
nothing new of that user or token is admitted until the use is back under the limit."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from berth.shared.capacity import Amounts
from berth.shared.messages import Quota

# The quota dimensions: (Amounts field, label in reasons, formatter).
QUOTA_DIMENSIONS = ("cpu", "mem", "dev")
_NONE = Amounts()  # a user holding nothing
_NO_QUOTA = Quota()  # no limit in any dimension


class Limits(msgspec.Struct, kw_only=True):
    """Every quota and token limit in force, as the admin events in the log set them."""

    default: Quota = Quota()
    quotas: dict[str, Quota] = {}
    tokens: dict[str, int] = {}
    # The log sequence of the newest change folded (0: none yet).
    seq: int = 0

    def quota(self, user: str) -> Quota:
        """The user's own quota, each dimension it leaves unset taken from the default."""
        own = self.quotas.get(user)
        if own is None:
            return self.default
        return Quota(**{d: getattr(own, d) if getattr(own, d) is not None
                        else getattr(self.default, d) for d in QUOTA_DIMENSIONS})


@dataclass
class Usage:
    """What live attempts hold: per user, and per token."""

    users: dict[str, Amounts] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    def copy(self) -> Usage:
        return Usage(dict(self.users), dict(self.tokens))


def _fmt(dim: str, amount: int) -> str:
    if dim == "cpu":
        return f"{amount / 1000:g}"
    return str(amount)


_LABELS = {"cpu": ("cpu", " cores"), "mem": ("memory", " MiB"), "dev": ("devices", "")}


def refusal(limits: Limits, usage: Usage, user: str, need: Amounts,
            tokens: Mapping[str, int], count: int = 1) -> str | None:
    """Why `count` tasks of `user`, each needing `need` and holding `tokens`, may not be
    admitted now, or None if they may."""
    if count <= 0:
        return None
    quota = limits.quota(user)
    used = usage.users.get(user, _NONE)
    for dim in QUOTA_DIMENSIONS:
        limit = getattr(quota, dim)
        want = getattr(need, dim) * count
        if limit is None or not want:
            continue
        now = getattr(used, dim)
        if now + want > limit:
            label, unit = _LABELS[dim]
            return (f"user quota {user or '-'}: {label} {_fmt(dim, now)}/{_fmt(dim, limit)}"
                    f"{unit} in use, needs {_fmt(dim, want)} more")
    for name, n in sorted(tokens.items()):
        token_limit = limits.tokens.get(name)
        if token_limit is None:
            return f"waiting for token {name} (no such token: `berth tokens set {name} N`)"
        now = usage.tokens.get(name, 0)
        if now + n * count > token_limit:
            return f"waiting for token {name} ({now}/{token_limit} in use)"
    return None


def take(usage: Usage, user: str, need: Amounts, tokens: Mapping[str, int],
         count: int = 1) -> None:
    """Records `count` tasks admitted."""
    _add(usage, user, need, tokens, count)


def give_back(usage: Usage, user: str, need: Amounts, tokens: Mapping[str, int],
              count: int = 1) -> None:
    """Records `count` tasks' attempts ended (their use returned)."""
    _add(usage, user, need, tokens, -count)


def _add(usage: Usage, user: str, need: Amounts, tokens: Mapping[str, int], n: int) -> None:
    # Run for every assignment and exit every fold folds: one Amounts made, not four.
    held = usage.users.get(user, _NONE)
    total = Amounts(held.cpu + need.cpu * n, held.mem + need.mem * n, held.disk,
                    held.dev + need.dev * n)
    if total == _NONE:
        usage.users.pop(user, None)
    else:
        usage.users[user] = total
    for name, k in tokens.items():
        left = usage.tokens.get(name, 0) + k * n
        if left:
            usage.tokens[name] = left
        else:
            usage.tokens.pop(name, None)


def over_limits(limits: Limits, usage: Usage, user: str, need: Amounts,
                tokens: Mapping[str, int]) -> list[str]:
    """How the use of `user` (in the dimensions `need` asks for) and of `tokens` exceeds
    the limits, just after a task needing them was admitted (empty when within): what the
    checker reports for an admission that should never have been made."""
    out = []
    quota = limits.quota(user)
    # Run for every assignment every fold folds, and most users have no quota.
    if quota != _NO_QUOTA:
        used = usage.users.get(user, _NONE)
        for dim in QUOTA_DIMENSIONS:
            limit = getattr(quota, dim)
            if limit is not None and getattr(need, dim) and getattr(used, dim) > limit:
                out.append(f"user {user or '-'}: {dim} {getattr(used, dim)} > quota {limit}")
    if not tokens:
        return out
    for name in sorted(tokens):
        limit = limits.tokens.get(name)
        n = usage.tokens.get(name, 0)
        if limit is None or n > limit:
            out.append(f"token {name}: {n} in use > limit {limit if limit is not None else 0}")
    return out


def apply_quota(limits: Limits, user: str, quota: Quota, seq: int) -> None:
    """An admin's QuotaSet: user "" sets the default."""
    if user:
        limits.quotas[user] = quota
    else:
        limits.default = quota
    limits.seq = max(limits.seq, seq)


def apply_token_limit(limits: Limits, name: str, limit: int, seq: int) -> None:
    limits.tokens[name] = limit
    limits.seq = max(limits.seq, seq)


def redis_fields(limits: Limits) -> dict[str, str]:
    """The limits as reserve.lua reads them (redis_keys.LIMITS): "qd" the default quota,
    "q:<user>" each user's own, "t:<name>" each token's limit, "seq" their version. A quota
    leaves out the dimensions it does not limit."""
    def quota_json(q: Quota) -> str:
        return msgspec.json.encode({d: getattr(q, d) for d in QUOTA_DIMENSIONS
                                    if getattr(q, d) is not None}).decode()

    out = {"seq": str(limits.seq), "qd": quota_json(limits.default)}
    out.update({f"q:{user}": quota_json(q) for user, q in limits.quotas.items()})
    out.update({f"t:{name}": str(n) for name, n in limits.tokens.items()})
    return out
