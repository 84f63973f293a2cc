"""Redis refuses what each berth user may not do, asserted from the server's own answers: no
connection without a password, `berth doctor`'s user only reads, the scheduler's user only
touches berth's keys. Passwords are made once per data dir, owner-only, and kept."""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as sync_redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from berth.cli import doctor_redis
from berth.shared import redis_auth, redis_io, redis_keys, servers
from berth.shared.capacity import Amounts
from berth.shared.config import RedisSettings, parse_sentinels
from berth.shared.reservations import ReservationStore

# valkey's WRONGPASS (redis-py keeps the text, not the code).
WRONGPASS = "invalid username-password pair or user is disabled"
HOST = Amounts(cpu=1000, mem=100, disk=0, dev=0)


@pytest.fixture
def redis_server(clean_servers: tuple[servers.ServerProcess, servers.RedisServer]
                 ) -> servers.RedisServer:
    server = clean_servers[1]
    if server.users is None:
        pytest.skip("a container's Redis has no berth users")
    return server


def client(server: servers.RedisServer, user: str | None) -> sync_redis.Redis:
    url = server.url_for(user) if user else server.url
    return sync_redis.Redis.from_url(url, decode_responses=True)


@pytest.fixture
def as_doctor(redis_server: servers.RedisServer) -> Iterator[sync_redis.Redis]:
    with client(redis_server, redis_auth.DOCTOR) as c:
        yield c


def test_a_client_without_a_password_is_refused(redis_server: servers.RedisServer) -> None:
    with client(redis_server, None) as anonymous, pytest.raises(
            AuthenticationError, match="must be called with the client already authenticated"):
        anonymous.get(redis_keys.EPOCH)
    wrong = f"redis://scheduler:not-the-password@127.0.0.1:{redis_server.port}/0"
    with sync_redis.Redis.from_url(wrong) as c, pytest.raises(AuthenticationError,
                                                               match=WRONGPASS):
        c.get(redis_keys.EPOCH)
    # The default user is off: even its name with a valid password gets nowhere.
    password = redis_server.url_for(redis_auth.ADMIN).split(":")[2].split("@")[0]
    with sync_redis.Redis(port=redis_server.port, password=password) as c, \
            pytest.raises(AuthenticationError, match=WRONGPASS):
        c.get(redis_keys.EPOCH)


@pytest.mark.parametrize(("command", "refused"), [
    (("SET", redis_keys.EPOCH, "99"), "'set' command"),
    (("INCR", redis_keys.EPOCH), "'incr' command"),
    (("DEL", redis_keys.LEADER), "'del' command"),
    (("HSET", redis_keys.host("w"), "cpu_used", "0"), "'hset' command"),
    (("EVAL", "return redis.call('SET', KEYS[1], '1')", 1, redis_keys.EPOCH), "'eval' command"),
    (("SCRIPT", "LOAD", "return 1"), "'script|load' command"),
    (("FCALL", "f", 0), "'fcall' command"),
    (("FLUSHALL",), "'flushall' command"),
    (("CONFIG", "SET", "appendonly", "no"), "'config|set' command"),
])
def test_the_doctor_user_cannot_write(as_doctor: sync_redis.Redis, command: tuple[str, ...],
                                      refused: str) -> None:
    with pytest.raises(NoPermissionError, match=f"User doctor has no permissions to run the "
                                                f"{refused}"):
        as_doctor.execute_command(*command)


async def test_the_doctor_user_reads_but_cannot_take_the_lease(
        redis_server: servers.RedisServer) -> None:
    scheduler = ReservationStore(redis_io.connect(redis_server.url_for(redis_auth.SCHEDULER)))
    doctor = ReservationStore(redis_io.connect(redis_server.url_for(redis_auth.DOCTOR)))
    try:
        epoch = await scheduler.acquire_lease("a", 60_000)
        await scheduler.register_host(epoch, "w1", HOST, "")
        with pytest.raises(NoPermissionError, match="no permissions to run the 'evalsha'"):
            await doctor.acquire_lease("b", 60_000)
        # Hosts are registered in a pipeline, which asks first whether its scripts are
        # loaded: that is what the doctor is refused.
        with pytest.raises(NoPermissionError,
                           match=r"no permissions to run the '(evalsha|script\|exists)'"):
            await doctor.register_host(epoch, "w2", HOST, "")
        hosts, groups = await doctor.usage()  # what the checker reads, in one MULTI
        assert [h.worker_id for h in hosts] == ["w1"] and groups == []
        assert await doctor.refused_double_bookings() == 0
        assert await doctor.client.get(redis_keys.LEADER) == f"a:{epoch}"
    finally:
        await scheduler.client.aclose()
        await doctor.client.aclose()


@pytest.mark.parametrize(("command", "refused"), [
    (("SET", "not-berth", "1"), "No permissions to access a key"),
    (("EVAL", "return redis.call('SET', 'elsewhere', '1')", 0),
     "ACL failure in script: No permissions to access a key"),
    (("FLUSHALL",), "'flushall' command"),
    (("KEYS", "*"), "'keys' command"),
    (("CONFIG", "SET", "appendonly", "no"), "'config|set' command"),
    (("ACL", "SETUSER", "doctor", "+@all"), "'acl|setuser' command"),
    (("REPLICAOF", "127.0.0.1", "1"), "'replicaof' command"),
])
def test_the_scheduler_user_stays_within_berths_keys(
        redis_server: servers.RedisServer, command: tuple[str, ...], refused: str) -> None:
    # (A script's own refusal comes back as a plain error, not NOPERM.)
    with client(redis_server, redis_auth.SCHEDULER) as c, \
            pytest.raises(ResponseError, match=refused):
        c.execute_command(*command)


def test_passwords_are_owner_only_and_kept_across_restarts(tmp_path: Path) -> None:
    first = servers.start_redis(tmp_path)
    try:
        with sync_redis.Redis.from_url(first.url_for(redis_auth.SCHEDULER)) as c:
            c.set(redis_keys.EPOCH, 5)
        scheduler_url = first.url_for(redis_auth.SCHEDULER)
    finally:
        first.stop()
    path = redis_auth.RedisUsers.path_of(tmp_path)
    for secret in (path, tmp_path / "redis" / "valkey.conf", tmp_path / "redis" / "users.acl"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    # The ACL file holds hashes, never a password.
    acl = (tmp_path / "redis" / "users.acl").read_text()
    assert not any(pw in acl for pw in json.loads(path.read_text())["users"].values())
    again = servers.start_redis(tmp_path, port=first.port)
    try:
        assert again.url_for(redis_auth.SCHEDULER) == scheduler_url
        with sync_redis.Redis.from_url(scheduler_url, decode_responses=True) as c:
            assert c.get(redis_keys.EPOCH) == "5"
    finally:
        again.stop()


def test_berth_doctor_uses_the_doctor_user_beside_berth_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("BERTH_REDIS_URL", "BERTH_REDIS_SENTINELS", "BERTH_REDIS_MASTER"):
        monkeypatch.delenv(name, raising=False)
    users = redis_auth.RedisUsers.ensure(tmp_path)
    (tmp_path / "stack.json").write_text(json.dumps({
        "redis_url": "redis://127.0.0.1:7001/0", "redis_sentinels": "127.0.0.1:7010",
        "redis_master": "m"}))
    settings = doctor_redis(str(tmp_path), None)
    assert settings.url == users.url(redis_auth.DOCTOR, 7001)
    assert settings.sentinels == (("127.0.0.1", 7010),) and settings.master == "m"
    assert doctor_redis(str(tmp_path), "redis://d:x@h:1/0").url == "redis://d:x@h:1/0"


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://doctor:s3cret@127.0.0.1:6379/0", "redis://doctor:***@127.0.0.1:6379/0"),
    ("redis://:s3cret@h:1/0", "redis://:***@h:1/0"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
])
def test_urls_are_shown_without_their_password(url: str, shown: str) -> None:
    assert redis_auth.redact(url) == shown


def test_with_user_replaces_credentials() -> None:
    assert redis_auth.with_user("redis://old:pw@10.0.0.1:6380/2", "doctor", "a/b") == \
        "redis://doctor:a%2Fb@10.0.0.1:6380/2"


@pytest.mark.parametrize(("raw", "problem"), [
    ("127.0.0.1", "'127.0.0.1' is not host:port"),
    ("h:port", "'h:port' is not host:port"),
    ("h:70000", "'h:70000' is not host:port"),
    (":26379", "':26379' is not host:port"),
])
def test_bad_sentinel_lists_are_one_line(raw: str, problem: str) -> None:
    with pytest.raises(SystemExit, match=f"BERTH_REDIS_SENTINELS: {problem}"):
        parse_sentinels(raw)


def test_sentinels_turn_on_waiting_for_a_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BERTH_REDIS_SENTINELS", "a:1, b:2")
    monkeypatch.delenv("BERTH_REDIS_WAIT_REPLICAS", raising=False)
    settings = RedisSettings.from_env("redis://x:y@h:1/0")
    assert settings.sentinels == (("a", 1), ("b", 2)) and settings.wait_replicas == 1
    monkeypatch.setenv("BERTH_REDIS_WAIT_REPLICAS", "0")
    assert RedisSettings.from_env("redis://h:1/0").wait_replicas == 0
    monkeypatch.setenv("BERTH_REDIS_WAIT_REPLICAS", "-1")
    with pytest.raises(SystemExit, match="BERTH_REDIS_WAIT_REPLICAS must be >= 0"):
        RedisSettings.from_env("redis://h:1/0")


def test_a_sentinel_answers_lookups_and_nothing_else(tmp_path: Path) -> None:
    cluster = servers.start_replicated_redis(tmp_path, replicas=1)
    try:
        port = cluster.sentinels[0].port
        with sync_redis.Redis(port=port, decode_responses=True) as anyone:
            assert anyone.execute_command("SENTINEL", "get-master-addr-by-name", "berth") == [
                "127.0.0.1", str(cluster.nodes[0].port)]
            for command in (("SENTINEL", "SET", "berth", "down-after-milliseconds", "1"),
                            ("SENTINEL", "FAILOVER", "berth"),
                            ("SENTINEL", "REMOVE", "berth"),
                            ("SENTINEL", "MONITOR", "evil", "127.0.0.1", "1", "1"),
                            ("ACL", "SETUSER", "default", "+@all")):
                with pytest.raises(NoPermissionError, match="User default has no permissions"):
                    anyone.execute_command(*command)
        # The replica authenticates as `replica`, which may not read the data.
        replica_url = cluster.users.url(redis_auth.REPLICA, cluster.nodes[1].port)
        with sync_redis.Redis.from_url(replica_url) as c, \
                pytest.raises(NoPermissionError, match="'get' command"):
            c.get(redis_keys.EPOCH)
    finally:
        cluster.stop()
