"""Many hosts on one machine: a test bed of network namespaces, and a nemesis that cuts them.

Each "host" is a network namespace with one interface (`eth0`) holding its own address in a
private test range, plugged into a bridge that lives in a namespace of its own. Nothing is
added to the machine's own network namespace: the veth pairs are made inside the host
namespaces with their other end moved straight into the bridge's.

    bed = Bed(["nats", "ctl", "w1"])
    bed.start()
    try:
        proc = bed.spawn("nats", ["nats-server", ...], log_path)   # ip netns exec …, a PID
        bed.partition({"w1"}, {"nats"})        # both ways; oneway=True: w1 → nats only
        bed.lose({"w1"}, {"nats"}, 15)         # 15% of the packets lost, both ways
        bed.heal()
        local_port = bed.portal("nats", 4222)  # 127.0.0.1:local_port reaches nats:4222
    finally:
        bed.stop()                             # every process, namespace and thread

The nemesis drops packets with `nft` rules in the *receiving* host's input chain: a real
partition loses packets silently (a rule on the sender's output would fail its send at
once with EPERM, which no real network does). A one-way cut drops what goes one way only.
Loss is the same rule with a random number drawn per packet (`numgen random mod 100 < N`):
TCP retransmits what is lost, as over a real lossy link.

Processes are started with `ip netns exec NAME` and stopped by PID. Namespace names carry a
prefix with the creating process's PID (`bnb<pid>-…`); `cleanup_stale` removes those whose
creator is gone (a crashed run), killing what still runs inside them.

`portal` lets the test (in the machine's namespace) reach a service inside the bed: a
listener on 127.0.0.1 whose connections are made from inside the service's own host, so a
partition never cuts the test's view. `proxy` puts a delaying TCP relay between two hosts
(netem is not available here). Both are threads that enter a namespace with setns(2), which
moves only the calling thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

PREFIX = "bnb"
CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")
TABLE = "berthbed"
# Each host's own table: an input chain the nemesis adds drop rules to and flushes.
_TABLE_DEF = (f"table inet {TABLE} {{\n"
              "  chain input { type filter hook input priority 0; policy accept; }\n"
              "}\n")

_libc = ctypes.CDLL(None, use_errno=True)
# How long services get to stop (and say goodbye through the servers) before the servers
# are stopped too, and how long everything gets before SIGKILL.
GOODBYE_S = 3.0
STOP_S = 10.0


class BedError(RuntimeError):
    pass


def _run(*argv: str, input: str | None = None, check: bool = True
         ) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=20)
    if check and done.returncode != 0:
        raise BedError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


def unavailable() -> str | None:
    """Why the bed cannot run here (one line), or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install {package})"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _run("ip", "netns", "add", probe)
    except (BedError, OSError) as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        _run("ip", "netns", "exec", probe, "nft", "-f", "-",
             input=_TABLE_DEF)
    except (BedError, OSError) as exc:
        return f"nft does not work inside a network namespace: {exc}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (PID 1 here may never reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def our_namespaces(owner: int | None = None) -> list[str]:
    """Namespaces this bed made: all of them, or those of the run with PID `owner`."""
    names = _run("ip", "netns", "list", check=False).stdout.split("\n")
    found = [line.split()[0] for line in names if line.strip()]
    mine = re.compile(rf"^{PREFIX}(\d+)-")
    return [n for n in found
            if (m := mine.match(n)) and (owner is None or int(m.group(1)) == owner)]


def _kill_inside(ns: str) -> None:
    """SIGKILLs whatever still runs in one of our namespaces (its leftovers: tasks and the
    like, started under a process we started there)."""
    for _ in range(20):
        pids = [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _delete_namespace(ns: str) -> None:
    _kill_inside(ns)
    _run("ip", "netns", "del", ns, check=False)


def cleanup_stale() -> list[str]:
    """Removes the namespaces of earlier runs whose process is gone (a crashed run)."""
    removed = []
    mine = re.compile(rf"^{PREFIX}(\d+)-")
    for ns in our_namespaces():
        m = mine.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _delete_namespace(ns)
            removed.append(ns)
    return removed


def _setns(ns_path: str) -> None:
    """Moves the calling thread (only it) into a network namespace."""
    fd = os.open(ns_path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns_path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _in_namespace(ns_path: str, fn: object, *args: object) -> object:
    """Runs fn(*args) in a fresh thread that has entered `ns_path` first."""
    result: list[object] = []
    error: list[BaseException] = []

    def body() -> None:
        try:
            _setns(ns_path)
            result.append(fn(*args))  # type: ignore[operator]
        except BaseException as exc:
            error.append(exc)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join()
    if error:
        raise error[0]
    return result[0]


class Bed:
    """N hosts on a bridge, each a network namespace with address `subnet`.(10 + i)."""

    def __init__(self, hosts: Sequence[str], subnet: str = "10.200.0") -> None:
        if len(set(hosts)) != len(hosts):
            raise ValueError("host names must differ")
        self.prefix = f"{PREFIX}{os.getpid()}-{os.urandom(2).hex()}"
        self.hosts = list(hosts)
        self.subnet = subnet
        self.addresses = {h: f"{subnet}.{10 + i}" for i, h in enumerate(hosts)}
        self.bridge_ns = f"{self.prefix}-br"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.servers: set[int] = set()  # PIDs stopped after the rest
        self.relays: list[Relay] = []
        self.made: list[str] = []

    # --- life -----------------------------------------------------------------------------

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        return self.addresses[host]

    def host_of(self, address: str) -> str:
        return next(h for h, a in self.addresses.items() if a == address)

    def start(self) -> Bed:
        cleanup_stale()
        try:
            self._make(self.bridge_ns)
            _run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
            for i, host in enumerate(self.hosts):
                ns = self.ns(host)
                self._make(ns)
                port = f"h{i}"
                _run("ip", "-n", ns, "link", "add", "eth0", "type", "veth",
                     "peer", "name", port, "netns", self.bridge_ns)
                _run("ip", "-n", self.bridge_ns, "link", "set", port, "master", "br0")
                _run("ip", "-n", self.bridge_ns, "link", "set", port, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.addresses[host]}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "netns", "exec", ns, "nft", "-f", "-", input=_TABLE_DEF)
        except BaseException:
            self.stop()
            raise
        return self

    def _make(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self.made.append(ns)

    def stop(self) -> None:
        """Stops every process started here (by PID; those spawned `server=True` a moment
        after the rest, so those can still say goodbye through them), every relay, then
        deletes every namespace made here (killing whatever a process left running inside)."""
        # The test's portals first (a service may wait on a connection still open through
        # one); relays between hosts after the services (some reach NATS through one).
        self._close_relays(portals=True)
        services = [p for p in self.procs if p.pid not in self.servers]
        self._signal(services, signal.SIGTERM)
        self._wait(services, GOODBYE_S)
        self._close_relays(portals=False)
        self._signal(self.procs, signal.SIGTERM)
        if self._wait(self.procs, STOP_S):
            self._signal(self.procs, signal.SIGKILL)
            self._wait(self.procs, STOP_S)
        self.procs.clear()
        self.servers.clear()
        for ns in reversed(self.made):
            _delete_namespace(ns)
        self.made.clear()

    def _close_relays(self, portals: bool) -> None:
        for relay in [r for r in self.relays if r.portal == portals]:
            relay.close()
            self.relays.remove(relay)

    @staticmethod
    def _signal(procs: list[subprocess.Popen[bytes]], sig: signal.Signals) -> None:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)

    @staticmethod
    def _wait(procs: list[subprocess.Popen[bytes]], timeout: float) -> bool:
        """Waits up to `timeout` for every process to exit; True if one has not."""
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return True
        return False

    def __enter__(self) -> Bed:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- processes ------------------------------------------------------------------------

    def spawn(self, host: str, argv: Sequence[str], log_path: Path | None = None,
              env: dict[str, str] | None = None, server: bool = False
              ) -> subprocess.Popen[bytes]:
        """Starts argv inside `host` (its own session, so it and its children can be
        signalled as a group); `ip netns exec` execs, so the PID is argv's own."""
        out: int | object = subprocess.DEVNULL
        log = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(log_path, "ab")  # noqa: SIM115 - the child keeps it
            out = log
        try:
            proc = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], env=env,
                                    stdout=out, stderr=subprocess.STDOUT,  # type: ignore[arg-type]
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            if log is not None:
                log.close()
        self.procs.append(proc)
        if server:
            self.servers.add(proc.pid)
        return proc

    def connect(self, host: str, address: str, port: int, timeout: float = 1.0
                ) -> socket.socket:
        """A TCP connection made from inside `host` (the socket stays in its namespace)."""
        sock = _in_namespace(str(NETNS_DIR / self.ns(host)), socket.create_connection,
                             (address, port), timeout)
        assert isinstance(sock, socket.socket)
        return sock

    def reachable(self, host: str, address: str, port: int, timeout: float = 1.0) -> bool:
        try:
            self.connect(host, address, port, timeout).close()
        except OSError:
            return False
        return True

    def wait_for_port(self, host: str, port: int, proc: subprocess.Popen[bytes], name: str,
                      timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BedError(f"{name} exited with code {proc.returncode} during start-up")
            if self.reachable(host, self.address(host), port, 0.3):
                return
            time.sleep(0.1)
        raise BedError(f"{name} did not listen on {host}:{port} within {timeout:.0f}s")

    # --- the nemesis ----------------------------------------------------------------------

    def drop(self, sources: Iterable[str], targets: Iterable[str], percent: int = 100
             ) -> None:
        """Packets from any of `sources` to any of `targets` are lost (one way): all of
        them, or each on its own `percent` chance (nft's random number per packet, so TCP
        sees real loss and retransmits through it)."""
        if not 0 < percent <= 100:
            raise ValueError(f"percent: {percent} is not in 1..100")
        verdict = "drop" if percent == 100 else f"numgen random mod 100 < {percent} drop"
        sources = list(sources)
        for target in targets:
            rules = "".join(
                f"add rule inet {TABLE} input ip saddr {self.addresses[s]} {verdict}\n"
                for s in sources if s != target)
            if rules:
                _run("ip", "netns", "exec", self.ns(target), "nft", "-f", "-", input=rules)

    def partition(self, side_a: Iterable[str], side_b: Iterable[str], oneway: bool = False
                  ) -> None:
        """Cuts side A from side B: both ways, or (oneway) only what A sends to B."""
        side_a, side_b = list(side_a), list(side_b)
        self.drop(side_a, side_b)
        if not oneway:
            self.drop(side_b, side_a)

    def lose(self, side_a: Iterable[str], side_b: Iterable[str], percent: int,
             oneway: bool = False) -> None:
        """Loses `percent` of the packets between side A and side B (each packet on its own
        chance): both ways, or (oneway) only what A sends to B. `heal` ends it."""
        side_a, side_b = list(side_a), list(side_b)
        self.drop(side_a, side_b, percent)
        if not oneway:
            self.drop(side_b, side_a, percent)

    def isolate(self, host: str) -> None:
        self.partition([host], [h for h in self.hosts if h != host])

    def heal(self) -> None:
        for host in self.hosts:
            _run("ip", "netns", "exec", self.ns(host), "nft", "flush", "chain", "inet", TABLE,
                 "input")

    def rules(self, host: str) -> str:
        return _run("ip", "netns", "exec", self.ns(host), "nft", "list", "chain", "inet",
                    TABLE, "input").stdout

    # --- reaching into the bed ------------------------------------------------------------

    def portal(self, host: str, port: int) -> int:
        """A port on the machine's 127.0.0.1 that reaches `host`:`port`, the connections made
        from inside `host` itself (so no partition cuts the test's view)."""
        relay = Relay(None, ("127.0.0.1", 0), str(NETNS_DIR / self.ns(host)),
                       (self.address(host), port))
        self.relays.append(relay)
        return relay.port

    def proxy(self, listen_host: str, target_host: str, target_port: int,
              listen_port: int = 0, delay: float = 0.0) -> int:
        """A relay listening in `listen_host` (on its address) that forwards to
        `target_host`:`target_port` from inside `target_host`, each chunk held back `delay`
        seconds each way. Returns the port it listens on."""
        relay = Relay(str(NETNS_DIR / self.ns(listen_host)),
                       (self.address(listen_host), listen_port),
                       str(NETNS_DIR / self.ns(target_host)),
                       (self.address(target_host), target_port), delay)
        self.relays.append(relay)
        return relay.port


def relay(target_port: int, delay: float = 0.0) -> Relay:
    """A relay on the machine's loopback to 127.0.0.1:`target_port`, no namespace needed:
    a way to cut (or slow) one process's connection to a server without root."""
    return Relay(None, ("127.0.0.1", 0), None, ("127.0.0.1", target_port), delay)


class Relay:
    """A threaded TCP relay: listens in one namespace, connects out from another (None: the
    caller's own; a relay between two loopback ports needs no namespace and no root).
    `cut()` holds every byte back both ways (the connections stay open, as over a real
    partition), `heal()` lets what was held through."""

    def __init__(self, listen_ns: str | None, listen: tuple[str, int], target_ns: str | None,
                 target: tuple[str, int], delay: float = 0.0) -> None:
        self.target = target
        self.delay = delay
        self.portal = listen_ns is None  # the test's way in, not a link between hosts
        self.closed = threading.Event()
        self.passing = threading.Event()
        self.passing.set()
        self.sockets: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        ready: queue.Queue[BaseException | int] = queue.Queue()
        self.listener: socket.socket | None = None
        t = threading.Thread(target=self._serve, args=(listen_ns, listen, target_ns, ready),
                             daemon=True)
        t.start()
        self.threads.append(t)
        got = ready.get(timeout=10)
        if isinstance(got, BaseException):
            raise got
        self.port = got

    def _serve(self, listen_ns: str | None, listen: tuple[str, int], target_ns: str,
               ready: queue.Queue[BaseException | int]) -> None:
        try:
            if listen_ns is not None:
                _setns(listen_ns)
            listener = socket.create_server(listen)
            listener.settimeout(0.2)
            self.listener = listener
            # Sockets accepted later stay in the listener's namespace; those this thread
            # connects from now on are made in the target's.
            if target_ns is not None:
                _setns(target_ns)
        except BaseException as exc:
            ready.put(exc)
            return
        ready.put(int(listener.getsockname()[1]))
        while not self.closed.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.settimeout(None)
                self.sockets.append(s)
            for src, dst in ((client, upstream), (upstream, client)):
                pump = threading.Thread(target=self._pump, args=(src, dst), daemon=True)
                pump.start()
                self.threads.append(pump)
        listener.close()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        held: queue.Queue[tuple[float, bytes]] = queue.Queue()
        sender = None
        if self.delay > 0:
            sender = threading.Thread(target=self._send_later, args=(held, dst), daemon=True)
            sender.start()
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if sender is None:
                    self.passing.wait()
                    dst.sendall(data)
                else:
                    held.put((time.monotonic() + self.delay, data))
        except OSError:
            pass
        finally:
            if sender is not None:
                held.put((0.0, b""))
                sender.join(timeout=self.delay + 1)
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def _send_later(self, held: queue.Queue[tuple[float, bytes]], dst: socket.socket) -> None:
        while True:
            due, data = held.get()
            if not data:
                return
            time.sleep(max(0.0, due - time.monotonic()))
            self.passing.wait()
            try:
                dst.sendall(data)
            except OSError:
                return

    def cut(self) -> None:
        self.passing.clear()

    def heal(self) -> None:
        self.passing.set()

    def close(self) -> None:
        self.closed.set()
        self.passing.set()
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        for t in self.threads:
            t.join(timeout=2)
