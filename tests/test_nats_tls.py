"""TLS to NATS for links that leave the host: a nats-server with a certificate from a CA
made here (trustme), a service connection that verifies it (BERTH_NATS_TLS_CA), and the
connections that must not get in: plain text, a client that does not trust the CA, and,
where the server asks for client certificates, a client without one."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.errors
import pytest
import trustme

from berth.shared import nats_io, servers, subjects
from berth.shared.config import Settings
from berth.shared.credentials import AuthDir, Role
from tests.netbed import relay


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    files = {name: root / f"{name}.pem" for name in
             ("ca", "server-cert", "server-key", "client-cert", "client-key")}
    ca.cert_pem.write_to_path(str(files["ca"]))
    server = ca.issue_cert("127.0.0.1")
    server.private_key_pem.write_to_path(str(files["server-key"]))
    server.cert_chain_pems[0].write_to_path(str(files["server-cert"]))
    client = ca.issue_cert("berth-client")
    client.private_key_pem.write_to_path(str(files["client-key"]))
    client.cert_chain_pems[0].write_to_path(str(files["client-cert"]))
    return files


def start(tmp_path: Path, pki: dict[str, Path], verify_clients: bool = False
          ) -> servers.ServerProcess:
    tls = servers.ServerTls(pki["server-cert"], pki["server-key"], pki["ca"], verify_clients)
    return servers.start_nats(tmp_path, tls=tls)


@pytest.fixture
def tls_server(tmp_path: Path, pki: dict[str, Path]) -> Iterator[servers.ServerProcess]:
    server = start(tmp_path, pki)
    yield server
    server.stop()


def service_settings(monkeypatch: pytest.MonkeyPatch, server: servers.ServerProcess,
                     data_dir: Path, **tls: str) -> Settings:
    monkeypatch.setenv("BERTH_NATS_URL", server.url)
    monkeypatch.setenv("BERTH_DATA_DIR", str(data_dir))
    monkeypatch.delenv("BERTH_NATS_CREDS", raising=False)
    for name in ("CA", "CERT", "KEY"):
        monkeypatch.setenv(f"BERTH_NATS_TLS_{name}", tls.get(name.lower(), ""))
    return Settings.from_env()


async def test_a_service_connects_over_tls_and_plain_text_is_refused(
        tls_server: servers.ServerProcess, pki: dict[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert tls_server.url.startswith("tls://127.0.0.1:")
    settings = service_settings(monkeypatch, tls_server, tmp_path, ca=str(pki["ca"]))
    nc = await nats_io.connect_service(settings, "berth-test", Role.ADMIN)
    try:
        js = nc.jetstream()
        await nats_io.ensure_streams(js, settings.stream_replicas)
        ack = await js.publish(subjects.SUBMIT_JOB, b"{}", stream=subjects.SUBMIT_STREAM)
        assert ack.seq == 1
        ssl_object = nc._transport._io_writer.get_extra_info("ssl_object")  # type: ignore[union-attr]
        assert ssl_object is not None and ssl_object.version() in ("TLSv1.2", "TLSv1.3")
    finally:
        await nc.close()

    # Plain text: the server's INFO says TLS is required, and a plain CONNECT is refused.
    with socket.create_connection(("127.0.0.1", tls_server.port), timeout=5) as conn:
        stream = conn.makefile("rwb")
        info = json.loads(stream.readline().split(b" ", 1)[1])
        assert info["tls_required"] is True
        stream.write(b'CONNECT {"verbose":false}\r\nPING\r\n')
        stream.flush()
        answer = stream.readline()
        assert answer == b"" or answer.startswith(b"-ERR"), answer  # closed, or told why

    # A client that does not trust berth's CA gets nowhere, identity or not.
    creds = AuthDir.of(tmp_path).ensure(Role.ADMIN)
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    with pytest.raises((nats.errors.NoServersError, ssl.SSLError)) as refused:
        await nats.connect(tls_server.url, connect_timeout=3, max_reconnect_attempts=0,
                           allow_reconnect=False, error_cb=on_error,
                           **nats_io.auth_options(creds))
    assert any("CERTIFICATE_VERIFY_FAILED" in e for e in [*errors, str(refused.value)])

    # Other NATS clients (INFO first, then TLS) are served too, with the CA.
    other = await nats.connect(tls_server.url, connect_timeout=3, allow_reconnect=False,
                               tls=nats_io.settings_tls(settings),
                               **nats_io.auth_options(creds))
    await other.close()


async def test_a_server_that_asks_for_client_certificates_gets_the_services(
        pki: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = start(tmp_path, pki, verify_clients=True)
    try:
        creds = AuthDir.of(tmp_path).ensure(Role.ADMIN)
        without = service_settings(monkeypatch, server, tmp_path, ca=str(pki["ca"]))
        with pytest.raises((nats.errors.NoServersError, ssl.SSLError, OSError)):
            await nats.connect(server.url, connect_timeout=3, max_reconnect_attempts=0,
                               allow_reconnect=False, **nats_io.auth_options(creds),
                               **nats_io.tls_options(nats_io.settings_tls(without)))
        settings = service_settings(monkeypatch, server, tmp_path, ca=str(pki["ca"]),
                                    cert=str(pki["client-cert"]), key=str(pki["client-key"]))
        nc = await nats_io.connect_service(settings, "berth-test", Role.ADMIN)
        try:
            await nc.flush(timeout=5)
        finally:
            await nc.close()
    finally:
        server.stop()


async def test_a_client_whose_handshake_comes_late_still_gets_tls(
        tls_server: servers.ServerProcess, pki: dict[str, Path], tmp_path: Path) -> None:
    """A link that holds every chunk 200 ms (a TCP proxy on a slow path): the server must
    still be waiting for berth's handshake, not have sent its plain INFO (`auto` waited
    50 ms, and such a client never got in: WRONG_VERSION_NUMBER on every try)."""
    slow = relay(tls_server.port, delay=0.2)
    try:
        nc = await asyncio.wait_for(nats_io.connect(
            f"tls://127.0.0.1:{slow.port}", "berth-test", AuthDir.of(tmp_path).ensure(Role.ADMIN),
            tls=nats_io.tls_context(str(pki["ca"]))), 10)
        try:
            await nc.flush(timeout=5)
        finally:
            await nc.close()
    finally:
        slow.close()


def test_tls_settings_that_cannot_work_end_the_service_with_a_reason(
        pki: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="need BERTH_NATS_TLS_CA"):
        nats_io.tls_context("", str(pki["client-cert"]), str(pki["client-key"]))
    with pytest.raises(SystemExit, match="go together"):
        nats_io.tls_context(str(pki["ca"]), str(pki["client-cert"]), "")
    with pytest.raises(SystemExit, match="NATS TLS files"):
        nats_io.tls_context(str(tmp_path / "missing.pem"))
    assert nats_io.tls_context("") is None


async def test_a_cluster_over_tls_routes_and_serves_clients_with_certificates(
        pki: dict[str, Path], tmp_path: Path) -> None:
    """Routes with `verify: true` (each node checks the others' certificates against the
    CA) and clients over TLS: the cluster forms, and holds R3 streams."""
    tls = servers.ServerTls(pki["server-cert"], pki["server-key"], pki["ca"])
    cluster = servers.start_nats_cluster(tmp_path, 3, tls=tls)
    try:
        assert all(node.url.startswith("tls://") for node in cluster.nodes)
        assert "verify: true" in cluster.configs[0].read_text()
        context = nats_io.tls_context(str(pki["ca"]))
        nc = await nats_io.connect(cluster.url, "test", cluster.admin_creds(), tls=context)
        try:
            js = nc.jetstream()
            await nats_io.ensure_streams(js, replicas=3)
            info = await js.stream_info(subjects.EVENTS_STREAM)
            assert info.config.num_replicas == 3 and info.cluster is not None
        finally:
            await nc.close()
    finally:
        cluster.stop()
