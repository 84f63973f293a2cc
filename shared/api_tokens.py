"""The dashboard API's tokens file: for each token, an identity name, a role and the token's
SHA-256 (never the token itself, so a copy of the file lets nobody in). `berth token`
writes it; the dashboard reads it (and re-reads it when it changes).

Format (JSON, owner-only 0600):
    {"v": 1, "tokens": [{"name": "ada", "role": "submit", "sha256": "<hex>",
                         "created_at": 1700000000.0}, ...]}
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import hashlib
import hmac
import os
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

FILE_VERSION = 1
# Identity names become NATS subject tokens (berth.submit.job.<name>): no dots, spaces or
# wildcards.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")


class Role(enum.StrEnum):
    READ = "read"  # reads only
    SUBMIT = "submit"  # reads, and submits and cancels its own jobs
    ADMIN = "admin"  # everything, any user's jobs


class TokenRecord(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    name: str
    role: Role
    sha256: str
    created_at: float = 0.0


class TokensFile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    v: int = FILE_VERSION
    tokens: list[TokenRecord] = []


class TokensFileError(Exception):
    """The file cannot be read or holds something that is not a tokens file; the message
    names the file and the problem in one line."""


def check_name(name: str) -> str:
    """`name` if it can be an identity; ValueError saying why not otherwise."""
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"name: {name!r} must be 1-64 letters, digits, '_' or '-'")
    return name


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def matches(token_digest: str, record: TokenRecord) -> bool:
    """Whether a presented token (by its digest) is `record`'s; constant time."""
    return hmac.compare_digest(token_digest, record.sha256)


def load(path: Path) -> TokensFile:
    """The file's tokens; an empty set when it does not exist."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return TokensFile()
    except OSError as exc:
        raise TokensFileError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = msgspec.json.decode(raw, type=TokensFile)
    except msgspec.DecodeError as exc:
        raise TokensFileError(f"{path}: not a tokens file: {exc}") from None
    if data.v != FILE_VERSION:
        raise TokensFileError(f"{path}: v: {data.v} is not {FILE_VERSION}")
    for record in data.tokens:
        try:
            check_name(record.name)
        except ValueError as exc:
            raise TokensFileError(f"{path}: {exc}") from None
    return data


def save(path: Path, data: TokensFile) -> None:
    """Writes the file owner-only, then renames it into place: a reader sees the old file or
    the new one, never half of one (and its inode changes, so a reload notices)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(data)) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _editing(path: Path) -> Iterator[None]:
    """One writer at a time: two `berth token` commands at once must not lose a token."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def create(path: Path, name: str, role: Role) -> str:
    """Mints a token for `name`, stores its hash, and returns the token (shown once)."""
    check_name(name)
    with _editing(path):
        data = load(path)
        if any(r.name == name for r in data.tokens):
            raise ValueError(f"name: {name!r} already has a token (revoke it first)")
        token = secrets.token_urlsafe(32)
        data.tokens.append(TokenRecord(name=name, role=role, sha256=digest(token),
                                       created_at=time.time()))
        save(path, data)
    return token


def revoke(path: Path, name: str) -> None:
    with _editing(path):
        data = load(path)
        kept = [r for r in data.tokens if r.name != name]
        if len(kept) == len(data.tokens):
            raise ValueError(f"name: no token named {name!r} in {path}")
        data.tokens = kept
        save(path, data)
