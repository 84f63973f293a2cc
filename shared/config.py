"""Configuration from environment variables, and for the `berth` command also from its
config file (profiles). Every variable, its default and its meaning is listed in
`docs/configuration.md`; this is the only place that reads them."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from berth.shared import durations
from berth.shared.bounded import MAX_MESSAGE_BYTES
from berth.shared.node_health import QuarantinePolicy
from berth.shared.usage import FairShare


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not a number") from None


def _env_duration(name: str, default: float) -> float:
    """A duration setting: seconds, or a number with s, m, h or d (shared/durations.py)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return durations.parse(raw)
    except ValueError as exc:
        raise SystemExit(f"{name}: {exc}") from None


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not an integer") from None


def _env_flag(name: str) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise SystemExit(f"{name}={raw!r} is not one of 1, true, yes, 0, false, no")


def _max_submit_bytes() -> int:
    """A submit becomes one JobSubmitted event and one run command per attempt, so it must
    fit in a message with room to spare (shared/bounded.py)."""
    value = _env_int("BERTH_MAX_SUBMIT_BYTES", 256 * 1024)
    if not 1024 <= value <= MAX_MESSAGE_BYTES:
        raise SystemExit(f"BERTH_MAX_SUBMIT_BYTES={value} is out of range: it must be between "
                         f"1024 and {MAX_MESSAGE_BYTES} (a submit must fit in one message)")
    return value


# A report waits at most this long for others: a final report must not wait long.
MAX_REPORT_COALESCE = 0.1

# Heartbeats a second the leader asks of the whole cluster (BERTH_HEARTBEAT_RATE): what
# 1,000 hosts cost at the default 1 s, so a larger cluster costs no more, up to the
# fence's bound on the interval (docs/reliability.md, "Paced heartbeats").
DEFAULT_HEARTBEAT_RATE = 1000.0


def _report_coalesce() -> float:
    value = _env_float("BERTH_REPORT_COALESCE", 0.002)
    if not 0 <= value <= MAX_REPORT_COALESCE:
        raise SystemExit(f"BERTH_REPORT_COALESCE={value:g} is out of range: it must be "
                         f"between 0 (off) and {MAX_REPORT_COALESCE:g} seconds")
    return value


def _fence_margin(dead_after: float) -> float:
    margin = _env_float("BERTH_FENCE_MARGIN", max(1.0, dead_after / 4))
    if not 0 < margin < dead_after:
        raise SystemExit(f"BERTH_FENCE_MARGIN={margin:g} must be above 0 and below "
                         f"BERTH_WORKER_DEAD_AFTER={dead_after:g}")
    return margin


def api_tokens_file(data_dir: str) -> str:
    """The dashboard API's tokens file (shared/api_tokens.py): BERTH_API_TOKENS_FILE, else
    under `data_dir` (so `berth token` and the dashboard agree on one data dir)."""
    return os.environ.get("BERTH_API_TOKENS_FILE") or os.path.join(
        data_dir, "auth", "api-tokens.json")


def metrics_port(environ: Mapping[str, str] | None = None) -> int:
    """BERTH_METRICS_PORT (0: off), from `environ` (default: this process's). `berth up`
    reads the one it would hand its children: there it is the first of a range of ports,
    one per child (berth/stack.py)."""
    raw = (os.environ if environ is None else environ).get("BERTH_METRICS_PORT") or "0"
    try:
        port = int(raw)
    except ValueError:
        raise SystemExit(f"BERTH_METRICS_PORT={raw!r} is not an integer") from None
    if not 0 <= port < 65536:
        raise SystemExit(f"BERTH_METRICS_PORT={port} is not a port (1-65535; 0 or unset: off)")
    return port


def co_located_go_procs(environ: Mapping[str, str] | None = None,
                        cpus: int | None = None) -> str:
    """GOMAXPROCS for a nats-server that `berth up` (or a test's stack) starts on the same
    machine as berth's services: the environment's own value if it sets one, else half the
    cores this process may use (at least 1). Go's default, every core, keeps idle threads
    spinning for work beside the services: on 2 cores nats-server spent ~22 % less CPU per
    W1 placement without it (docs/performance.md). A nats-server on hosts of its own
    (deploy/) keeps Go's default."""
    own = (os.environ if environ is None else environ).get("GOMAXPROCS", "").strip()
    if own:
        return own
    if cpus is None:
        cpus = len(os.sched_getaffinity(0))
    return str(max(1, cpus // 2))


def log_format() -> str:
    """BERTH_LOG_FORMAT: `text` (the default) or `json` (one object a line, with trace ids)."""
    value = os.environ.get("BERTH_LOG_FORMAT", "").strip().lower() or "text"
    if value not in ("text", "json"):
        raise SystemExit(f"BERTH_LOG_FORMAT={value!r} is not one of text, json")
    return value


def log_level() -> str:
    """BERTH_LOG_LEVEL: the services' log level."""
    return os.environ.get("BERTH_LOG_LEVEL", "INFO").upper()


def profile_dir() -> str:
    """BERTH_PROFILE_DIR: when set, each service runs under cProfile and writes
    `<service>-<pid>.prof` there on a clean stop (`bench/scale.py --profile`); its times
    are the main thread's CPU time."""
    return os.environ.get("BERTH_PROFILE_DIR", "")


# What the `berth` command reads. Each is a function on its own, not a Settings field:
# Settings.from_env checks the services' settings, and a bad scheduler setting in the
# environment must not stop `berth status`. Each takes, in order: its BERTH_* variable, then
# the selected profile of the config file (CLI_PROFILE_KEYS), else its default.

CLI_PROFILE_KEYS = {
    "nats_url": "NATS URL, or several comma-separated (as BERTH_NATS_URL)",
    "api_url": "dashboard API URL (as BERTH_API_URL)",
    "nats_creds": "credentials file on the bus (as BERTH_NATS_CREDS)",
    "api_token": "bearer token for the HTTP API (as BERTH_API_TOKEN)",
    "data_dir": "the folder of a local `berth up` (as BERTH_DATA_DIR)",
}


class ConfigFileError(ValueError):
    """The config file, or the profile asked for, cannot be used (one line)."""


_cli_profile: dict[str, str] | None = None
_cli_profile_name: str | None = None


def cli_config_path() -> Path:
    """BERTH_CONFIG, else $XDG_CONFIG_HOME/berth/config.toml (~/.config by default)."""
    given = os.environ.get("BERTH_CONFIG")
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "berth" / "config.toml"


def read_cli_profile(path: Path, name: str | None) -> dict[str, str]:
    """The settings of profile `name` (else the file's `default_profile`, else the profile
    called "default", else none) in the config file at `path`. A missing file is no
    settings; a named profile that is not there, or a key that is no setting, is an error."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        if name:
            raise ConfigFileError(f"profile {name!r}: there is no config file {path}") from None
        return {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigFileError(f"{path}: {exc}") from None
    profiles = data.get("profiles", {})
    if not isinstance(profiles, dict):
        raise ConfigFileError(f"{path}: profiles: must be a table of profiles")
    chosen = name or data.get("default_profile") or ""
    if not isinstance(chosen, str):
        raise ConfigFileError(f"{path}: default_profile: must be a profile's name")
    if chosen and chosen not in profiles:
        known = ", ".join(sorted(profiles)) or "none"
        raise ConfigFileError(f"{path}: profile {chosen!r}: not in the file (it has {known})")
    # Every profile is checked, not only the one used: a typo is said the first time.
    for profile_name, profile in profiles.items():
        where = f"{path}: profiles.{profile_name}"
        if not isinstance(profile, dict):
            raise ConfigFileError(f"{where}: must be a table")
        for key, value in profile.items():
            if key not in CLI_PROFILE_KEYS:
                raise ConfigFileError(f"{where}.{key}: not a setting (one of "
                                      f"{', '.join(CLI_PROFILE_KEYS)})")
            if not isinstance(value, str) or not value:
                raise ConfigFileError(f"{where}.{key}: must be a non-empty string")
    return {k: os.path.expanduser(v) if k in ("nats_creds", "data_dir") else v
            for k, v in profiles.get(chosen or "default", {}).items()}


def select_cli_profile(name: str | None) -> None:
    """The profile the `berth` command reads (its --profile, else BERTH_PROFILE); read at
    once, so a bad config file is said before anything connects."""
    global _cli_profile, _cli_profile_name
    _cli_profile_name = name or os.environ.get("BERTH_PROFILE") or None
    _cli_profile = read_cli_profile(cli_config_path(), _cli_profile_name)


def _cli_setting(variable: str, key: str) -> str | None:
    if os.environ.get(variable):
        return os.environ[variable]
    if _cli_profile is None:
        select_cli_profile(None)
    assert _cli_profile is not None
    return _cli_profile.get(key)


def cli_data_dir() -> str:
    """BERTH_DATA_DIR for the `berth` command: relative, as given (the default of --data-dir)."""
    return _cli_setting("BERTH_DATA_DIR", "data_dir") or ".berth"


def cli_nats_url() -> str | None:
    """BERTH_NATS_URL when set (else the command looks beside `berth up`)."""
    return _cli_setting("BERTH_NATS_URL", "nats_url")


def cli_api_url() -> str | None:
    """BERTH_API_URL when set (else the command looks beside `berth up`)."""
    return _cli_setting("BERTH_API_URL", "api_url")


def cli_api_token() -> str | None:
    """BERTH_API_TOKEN when set: the bearer token the command sends to the HTTP API."""
    return _cli_setting("BERTH_API_TOKEN", "api_token")


def cli_nats_creds() -> str | None:
    """BERTH_NATS_CREDS when set: the credentials file the command uses on the bus."""
    return _cli_setting("BERTH_NATS_CREDS", "nats_creds")


def bundle_max_bytes() -> int:
    """The size limit of one workspace bundle (BERTH_BUNDLE_MAX_MB, for `berth submit`)."""
    value = _env_float("BERTH_BUNDLE_MAX_MB", 256.0)
    if value <= 0:
        raise SystemExit(f"BERTH_BUNDLE_MAX_MB={value:g} must be above 0")
    return int(value * 1024 * 1024)


@dataclass(frozen=True)
class Settings:
    nats_url: str
    nats_creds: str
    nats_tls_ca: str
    nats_tls_cert: str
    nats_tls_key: str
    stream_replicas: int
    redis_url: str
    data_dir: str
    api_host: str
    api_port: int
    heartbeat_interval: float
    worker_dead_after: float
    lease_ttl: float
    kill_grace: float
    max_submit_bytes: int
    tick_interval: float
    pending_reason_interval: float
    api_token: str
    api_closed_reads: bool
    api_tokens_file: str
    snapshot_interval: float
    fence_margin: float
    # Workers: the bundle cache's size cap, concurrent BUILDING phases, and the age and
    # total size above which task directories are removed (docs/workspaces.md).
    bundle_cache_bytes: int = 4096 * 1024 * 1024
    # Each task directory its own writable copy of a bundle's files, not shared read-only
    # links to the cached ones (services/worker_agent/bundle_trees.py).
    bundle_copies: bool = False
    max_builds: int = 4
    # Workers: attempt reports made within this many seconds of each other go out as one
    # message (docs/protocol.md); 0: each alone.
    report_coalesce: float = 0.002
    task_dir_max_age: float = 7 * 24 * 3600.0
    task_dir_max_bytes: int = 0
    # Scheduler: how long a finished job stays in the events stream before the leader
    # compacts it out (docs/retention.md).
    job_retention: float = 7 * 24 * 3600.0
    # Scheduler: when a host whose attempts keep failing for non-user causes is quarantined
    # (docs/operations.md, "Node health").
    quarantine: QuarantinePolicy = field(default_factory=QuarantinePolicy)
    # Scheduler and dashboard: how users are interleaved within a band (docs/placement.md).
    fair_share: FairShare = field(default_factory=FairShare)
    # The Prometheus endpoint (docs/metrics.md): off (0) unless a port is set, and on the
    # loopback unless a host is, since metrics name workers and show the cluster's load.
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    # Scheduler: the heartbeats a second it asks of the whole cluster, by slowing every
    # worker's heartbeat (never below heartbeat_interval); 0: each keeps its own.
    heartbeat_rate: float = DEFAULT_HEARTBEAT_RATE

    @property
    def fence_after(self) -> float:
        """How long after sending a heartbeat that the scheduler then acknowledged a worker
        may keep its tasks running: less than the scheduler waits before it may declare the
        worker dead (from when it heard that heartbeat), by the margin (docs/reliability.md)."""
        return self.worker_dead_after - self.fence_margin

    @property
    def longest_heartbeat_interval(self) -> float:
        """The slowest heartbeat a leader may ask for: a third of fence_after, so two
        heartbeats in a row may go unanswered before a worker fences itself (or the
        configured interval, if that is longer already)."""
        return max(self.heartbeat_interval, self.fence_after / 3)

    def heartbeat_interval_asked(self, asked: float) -> float:
        """The interval a worker heartbeats at when the leader asks for `asked` seconds
        (0: nothing asked): never faster than its own, nor slower than the longest."""
        if not asked > 0:
            return self.heartbeat_interval
        return min(max(asked, self.heartbeat_interval), self.longest_heartbeat_interval)

    def __post_init__(self) -> None:
        if not 1 <= self.stream_replicas <= 5:
            raise SystemExit(f"BERTH_STREAM_REPLICAS={self.stream_replicas} is not 1 to 5 "
                             "(JetStream keeps at most 5 copies)")

    @classmethod
    def from_env(cls) -> Settings:
        data_dir = os.environ.get("BERTH_DATA_DIR", os.path.abspath(".berth"))
        return cls(
            nats_url=os.environ.get("BERTH_NATS_URL", "nats://127.0.0.1:4222"),
            nats_creds=os.environ.get("BERTH_NATS_CREDS", ""),
            nats_tls_ca=os.environ.get("BERTH_NATS_TLS_CA", ""),
            nats_tls_cert=os.environ.get("BERTH_NATS_TLS_CERT", ""),
            nats_tls_key=os.environ.get("BERTH_NATS_TLS_KEY", ""),
            stream_replicas=_env_int("BERTH_STREAM_REPLICAS", 1),
            redis_url=os.environ.get("BERTH_REDIS_URL", "redis://127.0.0.1:6379/0"),
            data_dir=data_dir,
            api_host=os.environ.get("BERTH_API_HOST", "127.0.0.1"),
            api_port=_env_int("BERTH_API_PORT", 8080),
            heartbeat_interval=_env_float("BERTH_HEARTBEAT_INTERVAL", 1.0),
            worker_dead_after=(dead_after := _env_float("BERTH_WORKER_DEAD_AFTER", 15.0)),
            lease_ttl=_env_float("BERTH_LEASE_TTL", 3.0),
            kill_grace=_env_float("BERTH_KILL_GRACE", 5.0),
            max_submit_bytes=_max_submit_bytes(),
            tick_interval=_env_float("BERTH_TICK_INTERVAL", 0.5),
            pending_reason_interval=_env_float("BERTH_PENDING_REASON_INTERVAL", 1.0),
            api_token=os.environ.get("BERTH_API_TOKEN", ""),
            api_closed_reads=_env_flag("BERTH_API_CLOSED_READS"),
            api_tokens_file=api_tokens_file(data_dir),
            snapshot_interval=_env_float("BERTH_SNAPSHOT_INTERVAL", 30.0),
            fence_margin=_fence_margin(dead_after),
            bundle_cache_bytes=_env_int("BERTH_BUNDLE_CACHE_MB", 4096) * 1024 * 1024,
            bundle_copies=_env_flag("BERTH_BUNDLE_COPIES"),
            max_builds=max(1, _env_int("BERTH_MAX_BUILDS", 4)),
            report_coalesce=_report_coalesce(),
            task_dir_max_age=_env_float("BERTH_TASK_DIR_MAX_AGE", 7 * 24 * 3600.0),
            task_dir_max_bytes=_env_int("BERTH_TASK_DIR_MAX_MB", 0) * 1024 * 1024,
            job_retention=_env_duration("BERTH_JOB_RETENTION", 7 * 24 * 3600.0),
            quarantine=_quarantine_policy(),
            fair_share=fair_share(),
            metrics_host=os.environ.get("BERTH_METRICS_HOST") or "127.0.0.1",
            metrics_port=metrics_port(),
            heartbeat_rate=_heartbeat_rate(),
        )


def _heartbeat_rate() -> float:
    rate = _env_float("BERTH_HEARTBEAT_RATE", DEFAULT_HEARTBEAT_RATE)
    if not rate >= 0:
        raise SystemExit(f"BERTH_HEARTBEAT_RATE={rate:g} must be 0 (workers keep their own "
                         "interval) or more (heartbeats a second)")
    return rate


def fair_share() -> FairShare:
    policy = FairShare(half_life=_env_float("BERTH_FAIR_SHARE_HALF_LIFE", 3600.0),
                       device_weight=_env_float("BERTH_FAIR_SHARE_DEVICE_WEIGHT", 16.0))
    if not policy.half_life > 0:
        raise SystemExit(f"BERTH_FAIR_SHARE_HALF_LIFE={policy.half_life:g} must be above 0 "
                         "(seconds)")
    if not policy.device_weight >= 0:
        raise SystemExit(f"BERTH_FAIR_SHARE_DEVICE_WEIGHT={policy.device_weight:g} must be 0 "
                         "or more")
    return policy


def _quarantine_policy() -> QuarantinePolicy:
    policy = QuarantinePolicy(failures=_env_int("BERTH_QUARANTINE_FAILURES", 3),
                              jobs=_env_int("BERTH_QUARANTINE_JOBS", 2),
                              window=_env_float("BERTH_QUARANTINE_WINDOW", 600.0),
                              max_share=_env_float("BERTH_QUARANTINE_MAX_SHARE", 0.25))
    if policy.failures < 0:
        raise SystemExit(f"BERTH_QUARANTINE_FAILURES={policy.failures} must be 0 (never) or more")
    if policy.jobs < 1:
        raise SystemExit(f"BERTH_QUARANTINE_JOBS={policy.jobs} must be 1 or more")
    if policy.window <= 0:
        raise SystemExit(f"BERTH_QUARANTINE_WINDOW={policy.window:g} must be above 0")
    if not 0 <= policy.max_share <= 1:
        raise SystemExit(f"BERTH_QUARANTINE_MAX_SHARE={policy.max_share:g} must be between 0 "
                         "and 1")
    return policy


def parse_sentinels(raw: str, name: str = "BERTH_REDIS_SENTINELS") -> tuple[tuple[str, int], ...]:
    """`host:port,host:port` -> ((host, port), ...); one clear line on anything else."""
    out: list[tuple[str, int]] = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise SystemExit(f"{name}: {item!r} is not host:port")
        out.append((host.strip("[]"), int(port)))
    return tuple(out)


@dataclass(frozen=True)
class RedisSettings:
    """How to reach Redis: the URL gives user, password and db (and the server itself when
    there are no sentinels); with sentinels, the primary is whatever they name."""

    url: str
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str = "berth"
    # Replica acknowledgements every fenced write waits for (WAIT), and for how long.
    wait_replicas: int = 0
    wait_timeout: float = 0.5

    @classmethod
    def from_env(cls, url: str | None = None) -> RedisSettings:
        sentinels = parse_sentinels(os.environ.get("BERTH_REDIS_SENTINELS", ""))
        # Replicas are what Sentinel fails over to: with them, a write no replica has is
        # a write a failover may lose, so fenced writes wait for one by default.
        wait_replicas = _env_int("BERTH_REDIS_WAIT_REPLICAS", 1 if sentinels else 0)
        wait_timeout = _env_float("BERTH_REDIS_WAIT_TIMEOUT", 0.5)
        if wait_replicas < 0 or wait_timeout <= 0:
            raise SystemExit("BERTH_REDIS_WAIT_REPLICAS must be >= 0 and "
                             "BERTH_REDIS_WAIT_TIMEOUT > 0")
        return cls(
            url=url or os.environ.get("BERTH_REDIS_URL") or "redis://127.0.0.1:6379/0",
            sentinels=sentinels,
            master=os.environ.get("BERTH_REDIS_MASTER") or "berth",
            wait_replicas=wait_replicas,
            wait_timeout=wait_timeout,
        )

    @staticmethod
    def url_from_env() -> str | None:
        """BERTH_REDIS_URL when set (`berth doctor` otherwise looks beside `berth up`)."""
        return os.environ.get("BERTH_REDIS_URL") or None
