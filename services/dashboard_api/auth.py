"""Who is calling: a bearer token names an identity and a role (read, submit, admin). The
admin token from BERTH_API_TOKEN is the identity `admin`; every other token is in the tokens
file (shared/api_tokens.py), re-read whenever it changes. Reads are open to anonymous
callers unless closed; actions always need a token."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException, PermissionDeniedException
from litestar.handlers.base import BaseRouteHandler
from litestar.types import Guard

from berth.shared import api_tokens
from berth.shared.api_tokens import Role, TokenRecord

log = logging.getLogger("berth.dashboard.auth")

ADMIN_IDENTITY = "admin"  # the identity of BERTH_API_TOKEN


@dataclass(frozen=True)
class Caller:
    name: str
    role: Role

    def owns(self, user: str) -> bool:
        """Whether this caller may act on (and see the env of) `user`'s jobs."""
        return self.role is Role.ADMIN or (self.role is Role.SUBMIT and self.name == user)


class Tokens:
    """The tokens a request may carry. The file is checked (one stat) on every lookup and
    re-read when it changed, so a token minted or revoked by `berth token` counts at once."""

    def __init__(self, admin_token: str, path: Path) -> None:
        self.admin_token = admin_token
        # Compared as digests, so the comparison's time does not depend on the length either.
        self._admin_digest = api_tokens.digest(admin_token) if admin_token else ""
        self.path = path
        self._records: list[TokenRecord] = []
        self._seen: tuple[int, int, int] | None = None  # inode, mtime, size of the file read

    def load(self) -> None:
        """Reads the file now; TokensFileError (one line) if it is unusable."""
        try:
            st: os.stat_result | None = os.stat(self.path)
        except OSError:
            st = None
        # Stamped before reading: a change while reading is read again at the next lookup.
        self._seen = _stamp(st)
        self._records = api_tokens.load(self.path).tokens
        # Whoever may write the file may let themselves in. (Group read is left alone: a
        # Kubernetes Secret mounted for the pod's group is 0440.)
        if st is not None and st.st_mode & 0o026:
            log.warning("%s is writable by others or readable by everyone: chmod 600 it",
                        self.path)

    def _refresh(self) -> None:
        try:
            stamp = _stamp(os.stat(self.path))
        except OSError:
            stamp = None
        if stamp == self._seen:
            return
        try:
            self.load()
        except api_tokens.TokensFileError as exc:
            # Fail closed: a broken file lets nobody in by it until it is fixed (the admin
            # token still works).
            self._records = []
            log.error("API tokens not loaded, file tokens refused until fixed: %s", exc)
            return
        log.info("API tokens read from %s: %d", self.path, len(self._records))

    @property
    def configured(self) -> bool:
        """Whether any token could be accepted."""
        self._refresh()
        return bool(self.admin_token or self._records)

    def lookup(self, token: str) -> Caller | None:
        self._refresh()
        found: Caller | None = None
        given = api_tokens.digest(token)
        if self._admin_digest and hmac.compare_digest(given, self._admin_digest):
            found = Caller(ADMIN_IDENTITY, Role.ADMIN)
        # Every record is compared (no early exit), each in constant time.
        for record in self._records:
            if api_tokens.matches(given, record) and found is None:
                found = Caller(record.name, record.role)
        return found

    def caller(self, connection: ASGIConnection) -> Caller | None:  # type: ignore[type-arg]
        """The request's caller; None without an Authorization header. A header that is not
        a known bearer token is a 401, never a silent anonymous read."""
        header = connection.headers.get("authorization")
        if header is None:
            return None
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise _token_required("send 'Authorization: Bearer <token>'")
        found = self.lookup(given.strip())
        if found is None:
            raise NotAuthorizedException(
                "the bearer token is not known here (revoked, mistyped, or never issued)",
                headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})
        return found


def _stamp(st: os.stat_result | None) -> tuple[int, int, int] | None:
    # The inode too: `berth token` renames a new file into place, so even two writes within
    # one mtime tick differ.
    return None if st is None else (st.st_ino, st.st_mtime_ns, st.st_size)


def _token_required(why: str) -> NotAuthorizedException:
    return NotAuthorizedException(f"a bearer token is required: {why}",
                                  headers={"WWW-Authenticate": "Bearer"})


def require(tokens: Tokens, connection: ASGIConnection,  # type: ignore[type-arg]
            action: str, roles: tuple[Role, ...]) -> Caller:
    """The caller, if its role may do `action`; 401 without a token, 403 with a weaker one."""
    who = tokens.caller(connection)
    if who is None:
        if not tokens.configured:
            raise PermissionDeniedException(
                f"{action} is disabled: no API token exists (set BERTH_API_TOKEN, or mint one "
                "with `berth token create NAME --role submit`)")
        raise _token_required("send 'Authorization: Bearer <token>'")
    if who.role not in roles:
        allowed = " or ".join(r.value for r in roles)
        raise PermissionDeniedException(
            f"token {who.name!r} has role {who.role.value}; {action} needs role {allowed}")
    return who


def action_guard(tokens: Tokens, action: str) -> Guard:
    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:  # type: ignore[type-arg]
        require(tokens, connection, action, (Role.SUBMIT, Role.ADMIN))

    return guard


def read_guard(tokens: Tokens, closed: bool) -> Guard:
    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:  # type: ignore[type-arg]
        # A token, when sent, is checked even where reads are open.
        if tokens.caller(connection) is None and closed:
            raise _token_required("reads are closed on this dashboard; send "
                                  "'Authorization: Bearer <token>' (any role)")

    return guard


def is_loopback(host: str) -> bool:
    """Whether binding to `host` keeps the API on this machine. Only `localhost` and literal
    loopback addresses count: any other name might resolve elsewhere, and an empty host,
    0.0.0.0 or :: mean every interface."""
    host = host.strip().strip("[]").rstrip(".").lower()
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def closed_reads_reason(host: str, closed_reads: bool) -> str | None:
    """Why reads need a token, or None when they are open."""
    if not is_loopback(host):
        return f"BERTH_API_HOST={host!r} is not a loopback address"
    if closed_reads:
        return "BERTH_API_CLOSED_READS is set"
    return None
