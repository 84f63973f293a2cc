"""The test bed itself: hosts that reach each other, a nemesis that cuts them and heals, and
nothing left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests import netbed
from tests.netbed import Bed

pytestmark = pytest.mark.netbed

# Each connection in a thread of its own, and a reset one ends only that connection: a test
# whose connection is stuck or reset (the loss test's) must not take the server from the next.
ECHO = """
import contextlib, socket, sys, threading

def serve(conn):
    with conn, contextlib.suppress(OSError):
        while data := conn.recv(4096):
            conn.sendall(data)

server = socket.create_server((sys.argv[1], int(sys.argv[2])))
while True:
    conn, _ = server.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""
PORT = 7000


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    if why := netbed.unavailable():
        pytest.skip(why)
    with Bed(["a", "b", "c"]) as bed:
        server = bed.spawn("a", [sys.executable, "-c", ECHO, bed.address("a"), str(PORT)])
        bed.wait_for_port("a", PORT, server, "echo")
        yield bed


def echo(bed: Bed, from_host: str, timeout: float = 1.0) -> bool:
    try:
        with bed.connect(from_host, bed.address("a"), PORT, timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(b"ping")
            return sock.recv(16) == b"ping"
    except OSError:
        return False


def test_hosts_have_their_own_addresses_and_reach_each_other(bed: Bed) -> None:
    assert echo(bed, "b") and echo(bed, "c")
    out = subprocess.run(["ip", "netns", "exec", bed.ns("b"), "ip", "-4", "-o", "addr"],
                         capture_output=True, text=True, check=True).stdout
    assert bed.address("b") in out and bed.address("a") not in out
    # The machine's own namespace got nothing: the service does not answer from there (a
    # connect may still succeed where the machine's network accepts any connection).
    import socket
    try:
        with socket.create_connection((bed.address("a"), PORT), 0.5) as sock:
            sock.settimeout(0.5)
            sock.sendall(b"ping")
            assert sock.recv(16) != b"ping"
    except OSError:
        pass


def test_a_partition_blocks_both_ways_and_heal_restores(bed: Bed) -> None:
    bed.partition(["b"], ["a"])
    try:
        assert not echo(bed, "b")
        assert echo(bed, "c")  # only b is cut off
    finally:
        bed.heal()
    assert echo(bed, "b")


def test_a_one_way_cut_loses_only_what_goes_that_way(bed: Bed) -> None:
    # a's answers to b are lost: b's SYN arrives, the SYN-ACK never does.
    bed.partition(["a"], ["b"], oneway=True)
    try:
        assert not echo(bed, "b")
        assert f"ip saddr {bed.address('a')} drop" in bed.rules("b")
        assert bed.address("b") not in bed.rules("a")
    finally:
        bed.heal()
    assert echo(bed, "b")


def test_an_open_connection_stalls_through_a_cut_and_resumes_after(bed: Bed) -> None:
    with bed.connect("b", bed.address("a"), PORT) as sock:
        bed.isolate("a")
        try:
            sock.settimeout(1)
            sock.sendall(b"held")
            with pytest.raises(TimeoutError):
                sock.recv(16)
        finally:
            bed.heal()
        sock.settimeout(10)  # TCP retransmits what was lost
        assert sock.recv(16) == b"held"


def test_loss_drops_a_share_of_the_packets_and_tcp_retransmits_through_it(bed: Bed) -> None:
    import socket
    ns = {h: str(netbed.NETNS_DIR / bed.ns(h)) for h in ("a", "b")}

    def udp(host: str) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((bed.address(host), 0))
        return sock

    receiver = netbed._in_namespace(ns["a"], udp, "a")
    sender = netbed._in_namespace(ns["b"], udp, "b")
    assert isinstance(receiver, socket.socket) and isinstance(sender, socket.socket)

    def arrived(n: int) -> int:
        for i in range(n):
            sender.sendto(b"%d" % i, receiver.getsockname())
        receiver.settimeout(0.3)
        got = 0
        with contextlib.suppress(TimeoutError):
            while got < n:
                receiver.recv(64)
                got += 1
        return got

    # Opened before the loss: a lost SYN waits 1 s, 3 s, 7 s, a lost segment of an open
    # connection from 0.2 s.
    conn = bed.connect("b", bed.address("a"), PORT)
    with receiver, sender, conn:
        bed.lose(["b"], ["a"], 30)
        try:
            assert "numgen random mod 100 < 30 drop" in bed.rules("a")
            # Each datagram on its own 30% chance: 280 of 400 expected, 9 the deviation.
            assert 200 <= arrived(400) <= 360
            # A segment lost five times in a row waits 0.2+0.4+0.8+1.6+3.2 s before its sixth
            # try (0.3^5: a few runs in a thousand per segment), so the bound allows that.
            conn.settimeout(30)
            for i in range(5):  # TCP gets every byte through, retransmitting
                conn.sendall(b"%d" % i)
                assert conn.recv(16) == b"%d" % i
        finally:
            bed.heal()
        assert arrived(200) == 200


def test_portal_and_a_delaying_proxy(bed: Bed) -> None:
    import socket
    port = bed.portal("a", PORT)
    with socket.create_connection(("127.0.0.1", port), 2) as sock:
        sock.sendall(b"via portal")
        assert sock.recv(64) == b"via portal"
    slow = bed.proxy("c", "a", PORT, delay=0.2)
    with bed.connect("b", bed.address("c"), slow, 2) as sock:
        sock.settimeout(5)
        started = time.monotonic()
        sock.sendall(b"slow")
        assert sock.recv(16) == b"slow"
        assert time.monotonic() - started >= 0.4  # 0.2 s each way


def test_teardown_leaves_nothing_even_after_a_failure() -> None:
    if why := netbed.unavailable():
        pytest.skip(why)
    bed = Bed(["x", "y"])
    names: list[str] = []
    inside: list[int] = []
    with pytest.raises(RuntimeError, match="the test failed"), bed:
        names = [bed.ns("x"), bed.ns("y"), bed.bridge_ns]
        proc = bed.spawn("x", ["sleep", "300"])
        # A grandchild in a session of its own: found and killed by its namespace.
        bed.spawn("y", ["sh", "-c", "setsid sleep 301 & wait"])
        for _ in range(50):
            inside = [int(p) for p in subprocess.run(
                ["ip", "netns", "pids", bed.ns("y")], capture_output=True, text=True
            ).stdout.split()]
            if len(inside) >= 2:
                break
            time.sleep(0.05)
        bed.partition(["x"], ["y"])
        raise RuntimeError("the test failed")
    assert proc.poll() is not None
    assert len(inside) >= 2 and not [p for p in inside if netbed.alive(p)]
    assert not set(names) & set(netbed.our_namespaces())
    assert not [n for n in os.listdir(netbed.NETNS_DIR) if n.startswith(bed.prefix)]


def test_stale_namespaces_of_a_crashed_run_are_removed() -> None:
    if why := netbed.unavailable():
        pytest.skip(why)
    gone = subprocess.Popen(["true"])
    gone.wait()  # a PID no live process has: the "crashed run"
    stale = f"{netbed.PREFIX}{gone.pid}-dead-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "300"],
                               start_new_session=True)
    try:
        assert stale in netbed.cleanup_stale()
        assert stale not in netbed.our_namespaces()
        assert sleeper.wait(5) == -signal.SIGKILL
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
