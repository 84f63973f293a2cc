"""The deployment files in deploy/: the Kubernetes manifests against the Kubernetes schemas
(kubernetes-validate's bundled ones, no network) and against each other (every Secret,
ConfigMap, Service and host name a workload names exists), the shipped nats-server, valkey
and Sentinel configurations by the real servers, and the systemd units by systemd-analyze."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import redis
import yaml
from kubernetes_validate.utils import all_versions

from berth.shared.credentials import AuthDir, Role
from berth.shared.redis_auth import DATA_NODE_RULES
from berth.shared.servers import (
    RouteAuth,
    free_port,
    nats_server_binary,
    redis_server_binary,
    routes_config,
    wait_for_port,
    write_nats_users,
)

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
KUBE = DEPLOY / "kubernetes"
SYSTEMD = DEPLOY / "systemd"
# Not applied (kustomization.yaml leaves it out): the shape of the Secrets an operator makes.
SECRETS_EXAMPLE = "secrets.example.yaml"
# The Kubernetes version the manifests are checked against; kubernetes-validate ships its
# schemas (and those of the versions before it).
KUBERNETES_VERSION = "1.33.0"

Doc = dict[str, Any]


def _docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _manifest_files() -> list[Path]:
    return sorted(p for p in KUBE.glob("*.yaml") if p.name != "kustomization.yaml")


def _all_docs() -> list[tuple[str, Doc]]:
    return [(p.name, d) for p in _manifest_files() for d in _docs(p)]


def _applied() -> list[Doc]:
    return [d for name, d in _all_docs() if name != SECRETS_EXAMPLE]


def _named(kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in _applied() if d["kind"] == kind}


def _one(kind: str, name: str) -> Doc:
    return _named(kind)[name]


WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet"}


def _workloads() -> list[Doc]:
    return [d for d in _applied() if d["kind"] in WORKLOAD_KINDS]


def _containers(pod: Doc) -> list[Doc]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _config_data(name: str, key: str) -> str:
    return str(_one("ConfigMap", name)["data"][key])


# --- the schemas ---------------------------------------------------------------------------


def test_the_pinned_kubernetes_version_is_shipped() -> None:
    minor = ".".join(KUBERNETES_VERSION.split(".")[:2])
    assert any(v.startswith(minor + ".") for v in all_versions()), all_versions()


@pytest.mark.parametrize(("filename", "doc"), _all_docs(),
                         ids=lambda x: x if isinstance(x, str) else
                         f"{x['kind']}/{x['metadata']['name']}")
def test_manifest_matches_the_kubernetes_schema(filename: str, doc: Doc) -> None:
    # strict: unknown fields (a misspelt key, silently ignored by a lenient apply) fail too.
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{filename}: {doc['kind']}/{doc['metadata']['name']} at {path}: "
                    f"{exc.message}")


def test_kustomization_lists_every_manifest_but_the_secrets_example() -> None:
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed))
    expected = {p.name for p in _manifest_files()} - {SECRETS_EXAMPLE}
    assert set(listed) == expected
    assert kustomization["namespace"] == "berth"
    for _, doc in _all_docs():
        assert "namespace" not in doc["metadata"], "the kustomization sets the namespace"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl here")
def test_kustomize_builds() -> None:
    out = subprocess.run(["kubectl", "kustomize", str(KUBE)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    built = [d for d in yaml.safe_load_all(out) if d]
    assert len(built) == len(_applied())
    assert all(d["metadata"].get("namespace") == "berth" for d in built if d["kind"] != "Namespace")


# --- cross-references a schema cannot check ------------------------------------------------


def _secret_keys() -> dict[str, set[str]]:
    return {d["metadata"]["name"]: set(d.get("stringData", {})) | set(d.get("data", {}))
            for d in _docs(KUBE / SECRETS_EXAMPLE)}


def _refs(pod: Doc) -> Iterator[tuple[str, str, str | None, bool]]:
    """(kind, name, key or None, optional) for every Secret and ConfigMap a pod names."""
    for volume in pod.get("volumes", []):
        for kind, field, name_key in (("Secret", "secret", "secretName"),
                                      ("ConfigMap", "configMap", "name")):
            if field in volume:
                source = volume[field]
                optional = bool(source.get("optional"))
                yield kind, source[name_key], None, optional
                for item in source.get("items", []):
                    yield kind, source[name_key], item["key"], optional
    for container in _containers(pod):
        for env_from in container.get("envFrom", []):
            for kind, field in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
                if field in env_from:
                    yield kind, env_from[field]["name"], None, False
        for env in container.get("env", []):
            source = env.get("valueFrom", {})
            for kind, field in (("Secret", "secretKeyRef"), ("ConfigMap", "configMapKeyRef")):
                if field in source:
                    ref = source[field]
                    yield kind, ref["name"], ref["key"], bool(ref.get("optional"))


def test_every_secret_and_configmap_a_workload_names_exists() -> None:
    secrets = _secret_keys()
    configmaps = {n: set(d.get("data", {})) for n, d in _named("ConfigMap").items()}
    missing = []
    for workload in _workloads():
        pod = workload["spec"]["template"]["spec"]
        for kind, name, key, optional in _refs(pod):
            known = secrets if kind == "Secret" else configmaps
            where = f"{workload['kind']}/{workload['metadata']['name']}"
            if name not in known:
                if not optional:
                    missing.append(f"{where}: {kind} {name}")
            elif key is not None and key not in known[name]:
                missing.append(f"{where}: key {key} of {kind} {name}")
    assert not missing, missing


def test_every_mount_names_a_volume_and_every_probe_port_exists() -> None:
    for workload in _workloads():
        pod = workload["spec"]["template"]["spec"]
        volumes = {v["name"] for v in pod.get("volumes", [])}
        volumes |= {c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates",
                                                                        [])}
        for container in _containers(pod):
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, (workload["metadata"]["name"], mount)
            ports = {p["name"] for p in container.get("ports", []) if "name" in p}
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                action = container.get(probe, {})
                port = (action.get("httpGet") or action.get("tcpSocket") or {}).get("port")
                if isinstance(port, str):
                    assert port in ports, (workload["metadata"]["name"], probe, port)


def _pod_labels() -> list[dict[str, str]]:
    return [w["spec"]["template"]["metadata"]["labels"] for w in _workloads()]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_every_service_and_budget_selects_pods_and_every_statefulset_has_its_service() -> None:
    for service in _named("Service").values():
        selector = service["spec"]["selector"]
        assert any(_selects(selector, labels) for labels in _pod_labels()), service
        for port in service["spec"]["ports"]:
            target = port.get("targetPort")
            if isinstance(target, str):
                assert any(target == p.get("name") for w in _workloads()
                           if _selects(selector, w["spec"]["template"]["metadata"]["labels"])
                           for c in w["spec"]["template"]["spec"]["containers"]
                           for p in c.get("ports", [])), (service["metadata"]["name"], target)
    for budget in _named("PodDisruptionBudget").values():
        selector = budget["spec"]["selector"]["matchLabels"]
        assert any(_selects(selector, labels) for labels in _pod_labels()), budget
    services = _named("Service")
    for workload in _workloads():
        selector = workload["spec"]["selector"]["matchLabels"]
        assert _selects(selector, workload["spec"]["template"]["metadata"]["labels"])
        if workload["kind"] == "StatefulSet":
            governing = services[workload["spec"]["serviceName"]]
            assert governing["spec"]["clusterIP"] == "None"
            assert governing["spec"].get("publishNotReadyAddresses") is True


def _host_names() -> Iterator[tuple[str, str]]:
    """(where, host) for every host name the manifests and configs connect to."""
    config = _one("ConfigMap", "berth-config")["data"]
    yield "BERTH_NATS_URL", re.sub(r"^nats://([^:/]+).*", r"\1", config["BERTH_NATS_URL"])
    scheduler = _one("Deployment", "scheduler")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value", "") for e in scheduler["env"]}
    for item in env["BERTH_REDIS_SENTINELS"].split(","):
        yield "BERTH_REDIS_SENTINELS", item.rsplit(":", 1)[0]
    yield "BERTH_REDIS_URL", re.sub(r"^redis://[^@]*@([^:/]+).*", r"\1", env["BERTH_REDIS_URL"])
    for host in re.findall(r"nats://([^:]+):6222", _config_data("nats-config", "nats.conf")):
        yield "nats.conf routes", host
    for name in ("start-valkey.sh", "start-sentinel.sh"):
        cm = "valkey-config" if name == "start-valkey.sh" else "sentinel-config"
        text = _config_data(cm, name)
        for host in re.findall(r"\b((?:valkey|sentinel)-\d+\.(?:valkey|sentinel))\b", text):
            yield name, host


def test_every_host_name_resolves_to_a_service_or_a_statefulset_pod() -> None:
    services = _named("Service")
    statefulsets = _named("StatefulSet")
    hosts = list(_host_names())
    assert len(hosts) > 10
    for where, host in hosts:
        pod, _, service = host.partition(".")
        if not service:
            assert host in services, (where, host)
            continue
        assert service in services, (where, host)
        name, _, ordinal = pod.rpartition("-")
        sts = statefulsets[name]
        assert sts["spec"]["serviceName"] == service, (where, host)
        assert int(ordinal) < sts["spec"]["replicas"], (where, host)


def test_replicas() -> None:
    assert _one("Deployment", "scheduler")["spec"]["replicas"] >= 2  # a leader and a standby
    assert _one("StatefulSet", "nats")["spec"]["replicas"] == 3
    assert _one("StatefulSet", "sentinel")["spec"]["replicas"] == 3
    assert _one("StatefulSet", "valkey")["spec"]["replicas"] >= 2
    routes = re.findall(r"nats://\S+:6222", _config_data("nats-config", "nats.conf"))
    assert len(routes) == 3
    assert "sentinel monitor berth @PRIMARY@ 6379 2" in _config_data("sentinel-config",
                                                                      "sentinel.conf")
    for name in ("nats", "valkey", "sentinel"):
        assert name in _named("PodDisruptionBudget")


def test_every_container_requests_resources_and_runs_unprivileged() -> None:
    for workload in _workloads():
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, workload["metadata"]["name"]
        for container in _containers(pod):
            where = f"{workload['metadata']['name']}/{container['name']}"
            requests = container.get("resources", {}).get("requests", {})
            assert {"cpu", "memory"} <= set(requests), where
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["capabilities"]["drop"] == ["ALL"], where


def test_berth_services_run_the_berth_command_with_their_own_credentials() -> None:
    creds_secret = {"scheduler": "berth-scheduler", "submitter": "berth-submitter",
                    "dashboard": "berth-dashboard"}
    for name, secret in creds_secret.items():
        pod = _one("Deployment", name)["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["command"] == ["berth", "run", name]
        env = {e["name"]: e.get("value") for e in container["env"]}
        mount = next(m for m in container["volumeMounts"] if m["name"] == "credentials")
        assert env["BERTH_NATS_CREDS"] == f"{mount['mountPath']}/nats-creds.json"
        volume = next(v for v in pod["volumes"] if v["name"] == "credentials")
        assert volume["secret"]["secretName"] == secret
    dashboard = _one("Deployment", "dashboard")["spec"]["template"]["spec"]["containers"][0]
    assert dashboard["readinessProbe"]["httpGet"]["path"] == "/healthz"
    worker = _one("DaemonSet", "worker")["spec"]["template"]["spec"]
    command = " ".join(worker["containers"][0]["command"])
    assert "berth run worker --id" in command and '--address "$HOST_IP"' in command
    fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
              for c in _containers(worker) for e in c["env"] if "valueFrom" in e}
    assert fields == {"NODE_NAME": "spec.nodeName", "HOST_IP": "status.hostIP"}
    # Only the init container sees every worker's credential.
    assert not any(m["name"] == "all-worker-credentials"
                   for m in worker["containers"][0]["volumeMounts"])


def test_the_worker_init_container_copies_only_its_nodes_credential(tmp_path: Path) -> None:
    init = _one("DaemonSet", "worker")["spec"]["template"]["spec"]["initContainers"][0]
    script = init["command"][2]
    all_creds = tmp_path / "all"
    all_creds.mkdir()
    (all_creds / "worker-ip-10-0-0-1-ec2-internal.creds").write_text('{"me": 1}')
    (all_creds / "worker-other.creds").write_text('{"other": 1}')
    out = tmp_path / "run"
    out.mkdir()
    script = (script.replace("/var/run/secrets/berth-workers", str(all_creds))
              .replace("/run/berth", str(out)))
    env = {"PATH": os.environ["PATH"], "NODE_NAME": "ip-10-0-0-1.ec2.internal"}
    subprocess.run(["sh", "-c", script], env=env, check=True, timeout=10)
    assert (out / "worker-id").read_text() == "ip-10-0-0-1-ec2-internal"
    assert (out / "nats-creds.json").read_text() == '{"me": 1}'
    assert stat.S_IMODE((out / "nats-creds.json").stat().st_mode) == 0o400
    env["NODE_NAME"] = "unknown"
    failed = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True,
                            timeout=10)
    assert failed.returncode == 1 and "worker-unknown.creds" in failed.stderr


# --- the shipped server configurations, by the servers themselves ---------------------------

def _users_conf(folder: Path) -> str:
    """nats-users.conf as `berth creds` renders it, for a few real identities."""
    auth = AuthDir(folder / "identities")
    for role in (Role.SCHEDULER, Role.SUBMITTER, Role.DASHBOARD, Role.ADMIN):
        auth.ensure(role)
    auth.ensure(Role.WORKER, "node-1")
    return write_nats_users(auth).read_text()


def _nats_test(conf: Path, env: dict[str, str]) -> None:
    result = subprocess.run([nats_server_binary(), "-t", "-c", str(conf)], capture_output=True,
                            text=True, timeout=30, env={**os.environ, **env})
    assert result.returncode == 0, result.stdout + result.stderr


def test_nats_server_accepts_the_kubernetes_config(tmp_path: Path) -> None:
    # Laid out as the pod mounts it: /etc/nats/config (ConfigMap), /etc/nats/auth (Secret).
    (tmp_path / "config").mkdir()
    (tmp_path / "auth").mkdir()
    (tmp_path / "config" / "nats.conf").write_text(_config_data("nats-config", "nats.conf"))
    (tmp_path / "auth" / "nats-users.conf").write_text(_users_conf(tmp_path))
    _nats_test(tmp_path / "config" / "nats.conf", {"POD_NAME": "nats-0"})
    # A broken users file fails the check: the include is read.
    (tmp_path / "auth" / "nats-users.conf").write_text("users = [ {nkey: x ]\n")
    with pytest.raises(AssertionError):
        _nats_test(tmp_path / "config" / "nats.conf", {"POD_NAME": "nats-0"})


def test_nats_server_accepts_the_host_config(tmp_path: Path) -> None:
    shutil.copy(DEPLOY / "nats-cluster.conf", tmp_path / "nats-cluster.conf")
    (tmp_path / "nats-users.conf").write_text(_users_conf(tmp_path))
    # cluster-routes.conf as `berth creds routes nats-1:6222,...` renders it.
    routes = [f"nats-{i}:6222" for i in (1, 2, 3)]
    auth = AuthDir(tmp_path / "identities")
    (tmp_path / "cluster-routes.conf").write_text(routes_config(RouteAuth.of(auth), routes))
    _nats_test(tmp_path / "nats-cluster.conf", {"NATS_SERVER_NAME": "nats-1"})
    # Without the routes file the node does not start: it is read.
    (tmp_path / "cluster-routes.conf").unlink()
    with pytest.raises(AssertionError):
        _nats_test(tmp_path / "nats-cluster.conf", {"NATS_SERVER_NAME": "nats-1"})


PASSWORDS = {"SCHEDULER-PASSWORD": "sched-pw", "REPLICA-PASSWORD": "repl-pw",
             "SENTINEL-PASSWORD": "sent-pw", "ADMIN-PASSWORD": "admin-pw",
             "DOCTOR-PASSWORD": "doctor-pw"}


def test_the_shipped_acl_is_the_one_berth_renders() -> None:
    """deploy/'s valkey ACL has every user berth makes, each with berth's own rules (so a
    rule tightened in shared/redis_auth.py cannot be forgotten here)."""
    shipped = {}
    for line in _example_secret("valkey-auth", "users.acl").splitlines():
        _, name, state, *rest = line.split()
        if name == "default":
            assert line == "user default off resetchannels -@all"
            continue
        assert state == "on" and rest[0].startswith(">"), line
        shipped[name] = " ".join(rest[1:])
    assert shipped == DATA_NODE_RULES


def _example_secret(name: str, key: str) -> str:
    """A key of secrets.example.yaml, its placeholder passwords made this test's."""
    secret = next(d for d in _docs(KUBE / SECRETS_EXAMPLE) if d["metadata"]["name"] == name)
    text = str(secret["stringData"][key])
    for placeholder, password in PASSWORDS.items():
        text = text.replace(placeholder, password)
    return text


def _fake_cli(bin_dir: Path, answer: str) -> None:
    """A valkey-cli that answers every SENTINEL question with `answer` (empty: no Sentinel)."""
    cli = bin_dir / "valkey-cli"
    cli.write_text(f"#!/bin/sh\nprintf '%s' '{answer}'\n" if answer else "#!/bin/sh\nexit 1\n")
    cli.chmod(0o755)


def _script_env(tmp_path: Path, name: str, script: str, hostname: str, cli_answer: str,
                server: str | None) -> tuple[list[str], dict[str, str], Path]:
    """Lays out a pod's mounts for a start script; returns its argv, env and run dir."""
    base = tmp_path / hostname
    for sub in ("config", "auth", "run", "bin", "data"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    cm = "valkey-config" if name == "valkey" else "sentinel-config"
    conf = "valkey.conf" if name == "valkey" else "sentinel.conf"
    (base / "config" / conf).write_text(_config_data(cm, conf))
    (base / "config" / script).write_text(_config_data(cm, script))
    for key in ("users.acl", "replica-password", "sentinel-password"):
        (base / "auth" / key).write_text(_example_secret("valkey-auth", key))
    _fake_cli(base / "bin", cli_answer)
    fake_server = base / "bin" / "valkey-server"
    if server is None:
        fake_server.write_text("#!/bin/sh\nexit 0\n")
        fake_server.chmod(0o755)
    else:
        fake_server.symlink_to(server)
    env = {"PATH": f"{base / 'bin'}:{os.environ['PATH']}", "HOSTNAME": hostname,
           "CONFIG_DIR": str(base / "config"), "SECRET_DIR": str(base / "auth"),
           "RUN_DIR": str(base / "run")}
    return ["sh", str(base / "config" / script)], env, base


@pytest.mark.parametrize(("hostname", "sentinel_says", "replicaof"), [
    ("valkey-0", "", None),                                 # fresh cluster: 0 is primary
    ("valkey-1", "", "valkey-0.valkey"),                    # fresh cluster: 1 replicates 0
    ("valkey-0", "valkey-2.valkey", "valkey-2.valkey"),     # 0 after a failover to 2
    ("valkey-2", "valkey-2.valkey", None),                  # 2 is the primary Sentinel names
    ("valkey-1", "(error) NOAUTH whatever", "valkey-0.valkey"),  # an error is no answer
])
def test_valkey_start_script_follows_sentinel(tmp_path: Path, hostname: str,
                                              sentinel_says: str, replicaof: str | None) -> None:
    argv, env, base = _script_env(tmp_path, "valkey", "start-valkey.sh", hostname,
                                  sentinel_says, None)
    subprocess.run(argv, env=env, check=True, timeout=10, capture_output=True)
    lines = (base / "run" / "valkey.conf").read_text().splitlines()
    assert f"replica-announce-ip {hostname}.valkey" in lines
    assert "masterauth repl-pw" in lines
    found = [line for line in lines if line.startswith("replicaof")]
    assert found == ([f"replicaof {replicaof} 6379"] if replicaof else [])


def _localise_valkey_conf(base: Path) -> None:
    """The pod's paths (/data, /etc/valkey/auth) made this test's."""
    conf = base / "config" / "valkey.conf"
    conf.write_text(conf.read_text().replace("dir /data", f"dir {base / 'data'}")
                    .replace("/etc/valkey/auth", str(base / "auth")))


class _Server:
    def __init__(self, argv: list[str], env: dict[str, str], port: int, log: Path) -> None:
        self.port = port
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        self.log = log

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _wait(check: Any, what: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_valkey_primary_replica_and_sentinel_start_from_the_shipped_configs(
        tmp_path: Path) -> None:
    server = redis_server_binary()
    servers: list[_Server] = []
    try:
        # The primary, as valkey-0 on a fresh cluster.
        p_port = free_port()
        argv, env, base = _script_env(tmp_path, "valkey", "start-valkey.sh", "valkey-0", "",
                                      server)
        _localise_valkey_conf(base)
        argv += ["--port", str(p_port), "--bind", "127.0.0.1"]
        servers.append(_Server(argv, env, p_port, tmp_path / "primary.log"))
        wait_for_port(p_port, servers[-1].proc, "valkey primary")
        # The replica: Sentinel names the primary (here by address, on its test port).
        r_port = free_port()
        argv, env, base = _script_env(tmp_path, "valkey", "start-valkey.sh", "valkey-1",
                                      "127.0.0.1", server)
        _localise_valkey_conf(base)
        argv += ["--port", str(r_port), "--bind", "127.0.0.1", "--replicaof", f"127.0.0.1 {p_port}"]
        servers.append(_Server(argv, env, r_port, tmp_path / "replica.log"))
        wait_for_port(r_port, servers[-1].proc, "valkey replica")
        # A Sentinel, told by its peers (the fake valkey-cli) that the primary is 127.0.0.1.
        s_port = free_port()
        argv, env, base = _script_env(tmp_path, "sentinel", "start-sentinel.sh", "sentinel-0",
                                      "127.0.0.1", server)
        conf = _config_data("sentinel-config", "sentinel.conf")
        # Sentinel monitors port 6379 in the cluster; here the primary's test port.
        (base / "config" / "sentinel.conf").write_text(
            conf.replace("@PRIMARY@ 6379", f"@PRIMARY@ {p_port}")
            .replace("dir /run/sentinel", f"dir {base / 'run'}"))
        argv += ["--port", str(s_port), "--bind", "127.0.0.1"]
        servers.append(_Server(argv, env, s_port, tmp_path / "sentinel.log"))
        wait_for_port(s_port, servers[-1].proc, "sentinel")

        password = _example_secret("berth-scheduler", "redis-password")
        primary = redis.Redis(port=p_port, username="scheduler", password=password,
                              decode_responses=True)
        assert primary.ping()
        primary.set("berth:probe", "1")
        assert primary.eval("return redis.call('GET', KEYS[1])", 1, "berth:probe") == "1"
        with pytest.raises(redis.exceptions.NoPermissionError):
            primary.set("elsewhere", "1")
        with pytest.raises(redis.exceptions.NoPermissionError):
            primary.config_get("*")
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=p_port).ping()  # the default user is off
        admin = redis.Redis(port=p_port, username="admin", password="admin-pw",
                            decode_responses=True)
        assert admin.config_get("appendonly") == {"appendonly": "yes"}
        assert redis.Redis(port=r_port, username="replica", password="repl-pw").ping()
        _wait(lambda: admin.info("replication")["connected_slaves"] == 1,
              "the replica to sync (user replica, masterauth from the script)")
        sentinel = redis.Redis(port=s_port, decode_responses=True)

        def sentinel_sees_primary_and_replica() -> bool:
            # num-slaves comes from the primary's INFO, which only an authenticated
            # Sentinel (user sentinel, auth-pass from the script) may read.
            m = sentinel.sentinel_master("berth")
            return bool(m["is_master"] and not m["is_sdown"] and m["num-slaves"] == 1)

        _wait(sentinel_sees_primary_and_replica, "Sentinel to see the primary and its replica")
        assert sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", "berth") == [
            "127.0.0.1", str(p_port)]
        # Anyone may look the primary up; only the sentinel user may reconfigure.
        with pytest.raises(redis.exceptions.NoPermissionError):
            sentinel.execute_command("SENTINEL", "REMOVE", "berth")
        peer = redis.Redis(port=s_port, username="sentinel", password="sent-pw",
                           decode_responses=True)
        assert peer.execute_command("SENTINEL", "CONFIG", "GET", "resolve-hostnames")
        for s in servers:
            assert s.proc.poll() is None, s.log.read_text()
    finally:
        for s in reversed(servers):
            s.stop()


# --- systemd units --------------------------------------------------------------------------

# What `systemd-analyze verify` says when a unit's program is not installed on this machine.
_NOT_INSTALLED = re.compile(r"^\S+\.service: Command (/opt/berth/\.venv/bin/berth|"
                            r"/usr/local/bin/nats-server) is not executable: No such file")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (Debian: apt-get install systemd)")
@pytest.mark.parametrize("unit", sorted(p.name for p in SYSTEMD.glob("*.service")))
def test_systemd_unit_verifies(unit: str) -> None:
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(SYSTEMD / unit)],
                            capture_output=True, text=True, timeout=60)
    complaints = [line for line in (result.stdout + result.stderr).splitlines()
                  if line.strip() and not _NOT_INSTALLED.match(line)]
    assert not complaints, complaints


def test_systemd_units_keep_credentials_out_of_world_readable_files() -> None:
    for path in SYSTEMD.glob("berth-*.service"):
        text = path.read_text()
        assert "LoadCredential=nats-creds.json:/etc/berth/credentials/" in text, path.name
        assert "Environment=BERTH_NATS_CREDS=%d/nats-creds.json" in text, path.name
        assert "NoNewPrivileges=yes" in text, path.name
        if path.name != "berth-worker.service":
            assert "ProtectSystem=strict" in text and "DynamicUser=yes" in text, path.name


def test_the_worker_uses_the_hosts_network_and_claims_no_ports() -> None:
    # --address is the host's IP, so tasks must listen in the host's network namespace; the
    # ports are berth's to hand out (named ports), not the pod's.
    worker = _one("DaemonSet", "worker")["spec"]["template"]["spec"]
    assert worker["hostNetwork"] is True
    assert worker["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert not any(c.get("ports") for c in _containers(worker))
