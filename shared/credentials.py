"""NATS identities: who may connect to the bus, with which role.

Each identity is an nkey pair (Ed25519, the NATS way): nats-server's config holds only the
public key with that identity's permissions (shared/bus_permissions.py); the identity's
credentials file holds the seed, the role and what the role is scoped to (a worker id, a
user name). nats-server verifies the signature, so a credentials file is the only way to be
that identity, and the permissions, not berth's code, decide what it may publish or read.

On disk (the auth folder, owner-only): `identities.json` lists the public half of every
identity; `<identity>.creds` is one identity's credentials file (JSON), the only file a
host running that identity needs (with `BERTH_NATS_CREDS` naming it)."""

from __future__ import annotations

import enum
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import msgspec

AUTH_DIR = "auth"
IDENTITIES_FILE = "identities.json"
# The part of a subject token an identity scope (worker id, user name) may use: no dots or
# wildcards, so a scope can never widen a permission.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class Role(enum.StrEnum):
    ADMIN = "admin"
    SCHEDULER = "scheduler"
    SUBMITTER = "submitter"
    DASHBOARD = "dashboard"
    WORKER = "worker"
    SUBMIT = "submit"  # a user who submits jobs and cancels their own


# Roles held by one identity each (a worker or a submitting user is scoped by its name).
SERVICE_ROLES = (Role.ADMIN, Role.SCHEDULER, Role.SUBMITTER, Role.DASHBOARD)


class CredentialsError(Exception):
    """A credentials file or identity name that cannot be used; the message says why."""


class Identity(msgspec.Struct, frozen=True, kw_only=True):
    """The public half: what nats-server's config is rendered from."""

    name: str
    role: Role
    public_key: str
    scope: str = ""  # the worker id (role worker) or user name (role submit)


class Credentials(msgspec.Struct, frozen=True, kw_only=True):
    """One identity's credentials file."""

    v: int = 1
    name: str
    role: Role
    seed: str
    scope: str = ""

    @property
    def public_key(self) -> str:
        return public_key_of(self.seed)

    @property
    def identity(self) -> Identity:
        return Identity(name=self.name, role=self.role, public_key=self.public_key,
                        scope=self.scope)

    @property
    def user(self) -> str | None:
        """Whose jobs this identity submits: its user for role submit; None (the bare,
        admin-only subjects) for admin."""
        return self.scope if self.role is Role.SUBMIT else None


def public_key_of(seed: str) -> str:
    # nkeys (and libsodium under it) is imported where a key is made or read: every `berth`
    # command imports this module, and most never touch a key.
    import nkeys

    try:
        key = nkeys.from_seed(bytearray(seed.encode()))
    except Exception as exc:  # nkeys raises its own classes and binascii/nacl errors
        raise CredentialsError(f"seed: not a NATS nkey seed ({exc.__class__.__name__})") from exc
    return str(key.public_key.decode())


def check_name(what: str, name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise CredentialsError(
            f"{what}: {name!r} must be 1-64 letters, digits, '-' or '_' (it becomes part of "
            "NATS subjects)")
    return name


def identity_name(role: Role, scope: str = "") -> str:
    if role is Role.WORKER:
        return f"worker-{check_name('worker id', scope)}"
    if role is Role.SUBMIT:
        return f"user-{check_name('user', scope)}"
    return role.value


def generate(role: Role, scope: str = "") -> Credentials:
    if role in (Role.WORKER, Role.SUBMIT) and not scope:
        what = "worker id" if role is Role.WORKER else "user"
        raise CredentialsError(f"role {role}: needs a {what}")
    import nkeys

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()
    return Credentials(name=identity_name(role, scope), role=role, seed=seed,
                       scope=scope if role in (Role.WORKER, Role.SUBMIT) else "")


_creds_decoder = msgspec.json.Decoder(Credentials)


def load(path: str | Path) -> Credentials:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise CredentialsError(f"cannot read NATS credentials {path}: {exc.strerror}") from exc
    if len(raw) > 64 * 1024:
        raise CredentialsError(f"{path}: too large for a credentials file")
    try:
        creds = _creds_decoder.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise CredentialsError(f"{path}: not a berth credentials file: {exc}") from exc
    public_key_of(creds.seed)
    return creds


def write_private(path: Path, data: bytes) -> None:
    """Writes a secret so that it is never readable by others, not even for a moment."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


@dataclass(frozen=True)
class AuthDir:
    """The auth folder of a data dir: every identity's public half, and the credentials
    files of those made here."""

    path: Path

    @classmethod
    def of(cls, data_dir: str | Path) -> AuthDir:
        return cls(Path(data_dir) / AUTH_DIR)

    def creds_path(self, name: str) -> Path:
        return self.path / f"{name}.creds"

    def identities(self) -> list[Identity]:
        try:
            raw = (self.path / IDENTITIES_FILE).read_bytes()
        except FileNotFoundError:
            return []
        return msgspec.json.decode(raw, type=list[Identity])

    def _save_identities(self, identities: list[Identity]) -> None:
        body = msgspec.json.format(msgspec.json.encode(sorted(identities, key=lambda i: i.name)))
        write_private(self.path / IDENTITIES_FILE, body + b"\n")

    def ensure(self, role: Role, scope: str = "") -> Credentials:
        """This identity's credentials, made (and registered) if it has none yet."""
        name = identity_name(role, scope)
        path = self.creds_path(name)
        if path.exists():
            return load(path)
        creds = generate(role, scope)
        write_private(path, msgspec.json.format(msgspec.json.encode(creds)) + b"\n")
        self.register(creds.identity)
        return creds

    def register(self, identity: Identity) -> None:
        others = [i for i in self.identities() if i.name != identity.name]
        self._save_identities([*others, identity])

    def revoke(self, name: str) -> bool:
        identities = self.identities()
        kept = [i for i in identities if i.name != name]
        self._save_identities(kept)
        self.creds_path(name).unlink(missing_ok=True)
        return len(kept) != len(identities)


def describe(creds: Credentials) -> str:
    scope = f" {creds.scope}" if creds.scope else ""
    return f"{creds.name} (role {creds.role}{scope})"


def dumps(creds: Credentials) -> str:
    return json.dumps(msgspec.to_builtins(creds), indent=2)


def for_service(creds_path: str, data_dir: str, role: Role, scope: str = "") -> Credentials:
    """A service's own credentials: the file BERTH_NATS_CREDS names, else the one `berth up`
    made in the data dir. A file of another role is refused here, with its name, rather than
    by nats-server later with a bare permissions violation."""
    path = creds_path or str(AuthDir.of(data_dir).creds_path(identity_name(role, scope)))
    creds = load(path)
    wanted = (Role.ADMIN, role)
    if creds.role not in wanted or (creds.role is role and scope and creds.scope != scope):
        want = f"role {role}" + (f" for {scope!r}" if scope else "")
        raise CredentialsError(f"{path}: is {describe(creds)}; this needs {want}")
    return creds
