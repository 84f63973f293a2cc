"""Redis identities: the ACL users berth's Redis servers (and Sentinels) accept, and their
passwords.

The `default` user is off, so nothing connects without a password. Each user may do only
its job: the scheduler reads and writes berth's keys and runs its scripts; `berth doctor`
only reads; replicas and Sentinels get the few commands replication and failover use; an
admin (tests, operators) may do anything.

The passwords are made once per data dir and kept, owner-only, in `<data dir>/auth/redis.json`:
`{"v": 1, "users": {"admin": ..., "scheduler": ..., "doctor": ..., "replica": ...,
"sentinel": ...}}`. The servers' ACLs hold only their SHA-256. (The names are those of
deploy/'s ACL.)"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from berth.shared.credentials import AUTH_DIR, write_private

REDIS_AUTH_FILE = "redis.json"

ADMIN = "admin"
SCHEDULER = "scheduler"
DOCTOR = "doctor"
REPLICA = "replica"
SENTINEL = "sentinel"
USERS = (ADMIN, SCHEDULER, DOCTOR, REPLICA, SENTINEL)

# What each user may do on a data node (valkey/Redis ACL rules, after `on #<hash>`).
# `-@dangerous` last: it takes back FLUSHALL, KEYS, DEBUG and the like from the categories.
# `resetchannels`: no pub/sub, except where a user needs it.
DATA_NODE_RULES = {
    ADMIN: "~* &* +@all",
    # Its keys only (a Lua script runs with its caller's ACL, so the scripts are held to
    # them too); scripts loaded and run, WAIT for replicas.
    SCHEDULER: ("resetchannels ~berth:* -@all +@read +@write +@transaction +@connection "
                "+select +evalsha +eval +script|load +script|exists +wait -@dangerous"),
    # Read-only keys (%R~) and read commands: no write, no script, whatever it sends.
    DOCTOR: ("resetchannels %R~berth:* -@all +@read +@connection +select +multi +exec "
             "+discard -@dangerous"),
    REPLICA: "resetchannels -@all +psync +replconf +ping",
    # What Sentinel sends to the nodes it watches and reconfigures.
    SENTINEL: ("resetchannels &__sentinel__:hello -@all +multi +exec +slaveof +replicaof +ping "
               "+subscribe +publish +config|rewrite +role +info +client|setname +client|kill "
               "+script|kill"),
}

# On a Sentinel: anyone may ask where the primary is (what a client asks before it has a
# server to log in to; no password is ever sent to a Sentinel), and nothing else; Sentinels
# talk to each other as `sentinel`; only the admin may reconfigure one (SENTINEL SET,
# MONITOR, FAILOVER, ...), so no one can point the scheduler at another primary.
SENTINEL_LOOKUP = ("resetchannels -@all +ping +hello +client|setinfo +client|setname "
                   "+sentinel|get-master-addr-by-name +sentinel|masters +sentinel|master "
                   "+sentinel|replicas +sentinel|slaves +sentinel|sentinels")
SENTINEL_RULES = {
    ADMIN: "~* &* +@all",
    SENTINEL: "~* &* +@all",
}


class RedisAuthError(Exception):
    """The passwords file is unusable; the message says why."""


@dataclass(frozen=True)
class RedisUsers:
    """The passwords of every Redis user of one data dir."""

    passwords: dict[str, str]
    path: Path

    @classmethod
    def path_of(cls, data_dir: str | Path) -> Path:
        return Path(data_dir) / AUTH_DIR / REDIS_AUTH_FILE

    @classmethod
    def load(cls, data_dir: str | Path) -> RedisUsers:
        path = cls.path_of(data_dir)
        try:
            raw = json.loads(path.read_text())
            passwords = raw["users"]
            if not isinstance(passwords, dict) or not all(
                    isinstance(passwords.get(u), str) and passwords[u] for u in USERS):
                raise ValueError(f"needs a password for each of {', '.join(USERS)}")
        except OSError as exc:
            raise RedisAuthError(f"cannot read Redis passwords {path}: {exc.strerror}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise RedisAuthError(f"{path}: not a berth Redis passwords file ({exc})") from None
        return cls({u: passwords[u] for u in USERS}, path)

    @classmethod
    def ensure(cls, data_dir: str | Path) -> RedisUsers:
        """This data dir's passwords, made the first time (and kept for every restart)."""
        path = cls.path_of(data_dir)
        if path.exists():
            return cls.load(data_dir)
        passwords = {u: secrets.token_urlsafe(24) for u in USERS}
        write_private(path, (json.dumps({"v": 1, "users": passwords}, indent=1) + "\n").encode())
        return cls(passwords, path)

    def acl_line(self, user: str, rules: str) -> str:
        return f"user {user} on #{password_hash(self.passwords[user])} {rules}"

    def data_node_acl(self) -> str:
        """The ACL file of a data node: every user, `default` off."""
        lines = ["user default off resetchannels -@all"]
        lines += [self.acl_line(u, DATA_NODE_RULES[u]) for u in USERS]
        return "\n".join(lines) + "\n"

    def sentinel_acl(self) -> str:
        """`user` directives for a Sentinel's config file."""
        lines = [f"user default on nopass {SENTINEL_LOOKUP}"]
        lines += [self.acl_line(u, rules) for u, rules in SENTINEL_RULES.items()]
        return "\n".join(lines) + "\n"

    def url(self, user: str, port: int, host: str = "127.0.0.1", db: int = 0) -> str:
        return user_url(user, self.passwords[user], host, port, db)


def password_hash(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


def user_url(user: str, password: str, host: str, port: int, db: int = 0) -> str:
    return f"redis://{quote(user, safe='')}:{quote(password, safe='')}@{host}:{port}/{db}"


def with_user(url: str, user: str, password: str) -> str:
    """`url` with these credentials in place of any it had."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def redact(url: str) -> str:
    """A Redis URL fit for a log line or a terminal: the password replaced by `***`."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = f"{parts.username}:" if parts.username else ":"
        netloc = f"{user}***@{parts.netloc.rsplit('@', 1)[1]}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    except ValueError:
        return "<unreadable Redis URL>"
