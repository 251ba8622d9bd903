"""Test hosts: network namespaces on a bridge, made and torn down by a test or a benchmark, so
that several "machines" talk over real TCP/IP on one machine (docs/architecture.md §6).

::

    this process's namespace (the test, a router)
      bridge tb<id>  10.A.B.1/24
        ├── veth tv<id>h1 ══ veth0 10.A.B.2/24, lo up   namespace tandem-<id>-h1
        ├── veth tv<id>h2 ══ veth0 10.A.B.3/24, lo up   namespace tandem-<id>-h2
        └── ...

``<id>`` is random (6 hex digits), so concurrent users on one machine never collide; the subnet
10.A.B.0/24 is drawn at random among those that overlap no address or route of this namespace
(checked and claimed under a lock file, so two callers never draw the same one). Host ``i``
(from 1) has address 10.A.B.(i+1); hosts reach each other and the bridge address over the bridge,
and each has its own loopback. Nothing is routed beyond the subnet: traffic goes only to
addresses of the hosts made here, or to 127.0.0.0/8 inside a host.

Making them needs root and ``ip`` (iproute2); ``HostsUnavailable`` says why when they cannot be
made (the callers skip or print it). ``close`` — also on an exception in the ``with`` body —
kills every process still running in the namespaces, deletes the namespaces (and with them the
veth pairs), then the bridge.

    with TestHosts(2) as net:
        server = net[0].popen([sys.executable, "-m", "http.server", "--bind", net[0].address])
        ...  # reach it from net[1], or from here, at net[0].address
"""
from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

NAMESPACE_PREFIX = "tandem-"
HOST_DEVICE = "veth0"
"""The name of each host's end of its veth pair, inside its namespace."""
_LOCK_PATH = "/tmp/tandem-netns.lock"
_SUBNET_TRIES = 64
_PROCESS_EXIT_S = 10.0
_PROBE = """
import socket, sys, time
end = time.monotonic() + float(sys.argv[3])
while True:
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()
        break
    except OSError:
        if time.monotonic() > end:
            raise
        time.sleep(0.05)
"""


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message says why."""


@dataclass(frozen=True, slots=True)
class Host:
    """One test host: namespace ``namespace``, address ``address`` on the bridge."""

    index: int
    namespace: str
    address: str
    started: list[subprocess.Popen] = field(default_factory=list, repr=False, compare=False)
    """Every process ``popen`` started here (killed by ``TestHosts.close``)."""

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(self.command(argv), **kwargs)
        self.started.append(proc)
        return proc

    def run(self, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), **kwargs)

    def pids(self) -> list[int]:
        """The processes running in this host now."""
        return _namespace_pids(self.namespace)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (without trying), or None when they may be."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, this is {sys.platform}"
    if shutil.which("ip") is None:
        return "network namespaces need the ip command (iproute2), which is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root (ip netns add), and this process is not root"
    return None


class TestHosts:
    """``count`` hosts on one bridge (see the module docstring); a context manager, or call
    ``open`` and ``close``. Raises ``HostsUnavailable`` from ``open`` when they cannot be made."""

    __test__ = False  # not a pytest test class

    def __init__(self, count: int) -> None:
        assert 1 <= count <= 250, count
        self.count = count
        self.id = f"{random.getrandbits(24):06x}"
        self.bridge = f"tb{self.id}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.hosts: list[Host] = []

    @property
    def bridge_address(self) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    def __enter__(self) -> TestHosts:
        return self.open()

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def open(self) -> TestHosts:
        reason = unavailable_reason()
        if reason is not None:
            raise HostsUnavailable(reason)
        try:
            with _subnet_lock():
                self.subnet = _free_subnet(_used_networks())
                self._make_bridge()
            for i in range(1, self.count + 1):
                self.hosts.append(self._make_host(i))
            self._check_reachable()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill what runs in the hosts, delete them and the bridge; safe to call twice."""
        for host in self.hosts:
            _kill_started(host.started)
        namespaces = [f"{NAMESPACE_PREFIX}{self.id}-h{i}" for i in range(1, self.count + 1)]
        for namespace in namespaces:
            if _namespace_exists(namespace):
                _kill_processes(namespace)
                _ip("netns", "del", namespace, check=False)
        for i in range(1, self.count + 1):  # normally gone with their namespace
            if _link_exists(self._veth(i)):
                _ip("link", "del", self._veth(i), check=False)
        if _link_exists(self.bridge):
            _ip("link", "del", self.bridge, check=False)
        self.hosts = []

    def bytes_to_host(self, i: int) -> int:
        """Bytes the bridge has sent to host ``i`` (from 1) so far: what crossed its veth pair
        towards it."""
        with open(f"/sys/class/net/{self._veth(i)}/statistics/tx_bytes") as counter:
            return int(counter.read())

    def _veth(self, i: int) -> str:
        return f"tv{self.id}h{i}"

    def _make_bridge(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_address}/{self.subnet.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def _make_host(self, i: int) -> Host:
        namespace = f"{NAMESPACE_PREFIX}{self.id}-h{i}"
        address = str(self.subnet.network_address + 1 + i)
        _ip("netns", "add", namespace)
        _ip("link", "add", self._veth(i), "type", "veth", "peer", "name", HOST_DEVICE, "netns", namespace)
        _ip("link", "set", self._veth(i), "master", self.bridge)
        _ip("link", "set", self._veth(i), "up")
        _ip("-n", namespace, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", HOST_DEVICE)
        _ip("-n", namespace, "link", "set", HOST_DEVICE, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        return Host(i, namespace, address)

    def _check_reachable(self, timeout_s: float = 10.0) -> None:
        """Every host connects over TCP to a listener on the bridge address: the bridge forwards
        (a host firewall could drop bridged traffic)."""
        with socket.create_server((self.bridge_address, 0)) as server:
            port = server.getsockname()[1]
            probes = [h.popen([sys.executable, "-c", _PROBE, self.bridge_address, str(port), str(timeout_s)],
                              stderr=subprocess.PIPE, text=True) for h in self.hosts]
            for host, proc in zip(self.hosts, probes):
                _, err = proc.communicate(timeout=timeout_s + 10)
                if proc.returncode != 0:
                    raise HostsUnavailable(f"host {host.namespace} ({host.address}) cannot reach the bridge "
                                           f"address {self.bridge_address} over TCP: {err.strip()[-300:]}")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise HostsUnavailable(f"`ip {' '.join(args)}` failed (status {done.returncode}): "
                               f"{done.stderr.strip() or done.stdout.strip()}")
    return done


def _namespace_exists(namespace: str) -> bool:
    return os.path.exists(f"/run/netns/{namespace}")


def _link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def _namespace_pids(namespace: str) -> list[int]:
    return [int(p) for p in _ip("netns", "pids", namespace, check=False).stdout.split()]


def _kill_started(procs: Sequence[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(_PROCESS_EXIT_S)


def _kill_processes(namespace: str) -> None:
    """SIGKILL every process in ``namespace`` (all of them were started in it by our caller) and
    wait until they are gone: a namespace with a process in it outlives ``ip netns del``."""
    deadline = time.monotonic() + _PROCESS_EXIT_S
    while pids := _namespace_pids(namespace):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)  # a killed child of ours is a zombie until reaped, and is listed no more


@contextlib.contextmanager
def _subnet_lock():
    with open(_LOCK_PATH, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network of an address or a route of this namespace (all tables)."""
    lines = _ip("-4", "-o", "addr", "show").stdout.splitlines()
    networks = []
    for line in lines:
        fields = line.split()
        if "inet" in fields:
            networks.append(ipaddress.ip_interface(fields[fields.index("inet") + 1]).network)
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines():
        fields = line.split()
        if fields and fields[0] in ("local", "broadcast", "unicast", "blackhole", "unreachable", "prohibit"):
            fields = fields[1:]
        if fields and fields[0] != "default":
            with contextlib.suppress(ValueError):
                networks.append(ipaddress.ip_network(fields[0], strict=False))
    return networks


def _free_subnet(used: Sequence[ipaddress.IPv4Network]) -> ipaddress.IPv4Network:
    """A random 10.A.B.0/24 (A in 64..254, clear of the 10.0.x.y ranges most set-ups use) that
    overlaps none of ``used``."""
    rng = random.Random()
    for _ in range(_SUBNET_TRIES):
        subnet = ipaddress.ip_network(f"10.{rng.randint(64, 254)}.{rng.randint(0, 255)}.0/24")
        if not any(subnet.overlaps(n) for n in used):
            return subnet
    raise HostsUnavailable(f"no free 10.x.y.0/24 subnet found in {_SUBNET_TRIES} random tries")
