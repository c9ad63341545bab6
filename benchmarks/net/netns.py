"""Two Linux network namespaces joined by a link with a one-way delay, for ranks that talk
over a link.

:func:`delayed_link` creates namespaces ``<prefix>a`` and ``<prefix>b`` with one end of a
link in each (``10.213.<n>.1`` and ``.2``, private addresses) and a delay of ``delay_ms`` on
each direction (the round trip gets twice it), made one of two ways (:attr:`Link.delay_kind`):

* ``"netem"``: a veth pair with a ``tc netem`` delay on both ends, where the kernel has the
  ``sch_netem`` module;
* ``"tun-relay"``: where it has not (:attr:`Link.netem_error` says why), a TUN device in each
  namespace and a relay process (``tunrelay.py``) that writes every packet read from one into
  the other ``delay_ms`` late, unchanged and in order. Its own latency and throughput come on
  top (``linkprobe.py`` measures them; ``benchmarks/train/RESULTS-learner.md`` has the figures).

With no delay asked it is a plain veth pair (``"none"``). :func:`veth_pair` is the veth pair
with netem or nothing.

:func:`hosts` makes N namespaces that look like N machines on one network: each has an
``eth0`` with an address of its own, joined through a hub namespace (a bridge, routing
between its ports), and a delay on the links of the hosts named in ``delayed`` (netem on
both ends of their veth pair, else a TUN relay between the host and the hub)::

    host 0  eth0 10.214.<n>.1 --veth--+
    host 1  eth0 10.214.<n>.2 --veth--+-- br0 10.214.<n>.254 [hub, forwarding]
    host 2  eth0 10.215.<n>.3 --TUN relay, delay--  10.215.<n>.130 [hub]

Every host reaches every other host (routes through the hub); the round trip to a delayed
host pays its delay twice. Host names resolve as on a real network: ``/etc/netns/<namespace>/hosts``
lists every host (and ``ip netns exec`` mounts it on ``/etc/hosts``). ``python netns.py exec
NAMESPACE COMMAND...`` runs a command in a namespace under its own host name (the namespace's
name), seeing that hosts file: the way to start a program "on" a host.

Everything is removed on the way out, also after an error. A process
(a rank) moves itself into one with :func:`enter` before it opens any socket. Needs root
(CAP_NET_ADMIN and CAP_SYS_ADMIN), the ``ip`` tool, and ``/dev/net/tun`` for the relay.

Usage::

    with delayed_link(delay_ms=0.25) as link:
        ...  # rank r: enter(link.namespaces[r]); connect to link.addresses[0]
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import select
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUTS = 0x04000000
_NETNS_DIR = "/var/run/netns"
KINDS = ("auto", "netem", "tun-relay")
_RELAY = Path(__file__).with_name("tunrelay.py")
_RELAY_MTU = 65000  # few, large packets: the relay's cost is per packet
_RELAY_START_S = 20.0
_SERIAL = itertools.count()


@dataclass(frozen=True)
class Link:
    """A live link: namespace, address and interface of each end, and the delay in place."""

    namespaces: tuple[str, str]
    addresses: tuple[str, str]
    ifnames: tuple[str, str]
    delay_ms: float  # the one-way delay in place on each direction (0 when none)
    netem_error: str  # why netem could not be used ('' when it was, or was not tried)
    delay_kind: str = "none"  # "netem", "tun-relay" or "none": what makes the delay
    relay_pid: int = 0  # the TUN relay's process id (0: no relay)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (not root here)"
    if shutil.which("ip") is None:
        return "the ip tool (iproute2) is not installed"
    name = f"srprobe{os.getpid()}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"ip netns add failed: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    return None


def tun_unavailable() -> str | None:
    """Why the TUN relay cannot run here (None when it can): no root, no ``ip``, or no TUN."""
    why = unavailable()
    if why:
        return why
    name = f"srtun{os.getpid() % 1_000_000}"
    probe = subprocess.run(["ip", "tuntap", "add", "dev", name, "mode", "tun"], capture_output=True,
                           text=True, check=False)
    if probe.returncode != 0:
        return f"no TUN devices (ip tuntap add failed: {probe.stderr.strip()})"
    subprocess.run(["ip", "tuntap", "del", "dev", name, "mode", "tun"], capture_output=True, check=False)
    return None


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def _netem(ns: str, dev: str, delay_ms: float) -> str:
    """Put a netem delay on ``dev``; returns '' or why it failed."""
    if shutil.which("tc") is None:
        return "the tc tool is not installed"
    proc = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "netem",
                           "delay", f"{delay_ms}ms"], capture_output=True, text=True, check=False)
    return "" if proc.returncode == 0 else f"tc qdisc add ... netem delay {delay_ms}ms: {proc.stderr.strip()}"


def veth_pair(delay_ms: float = 0.0, subnet: int | None = None) -> AbstractContextManager[Link]:
    """Two namespaces joined by a veth pair, with a netem delay of ``delay_ms`` on each end
    when the kernel has netem, else none (``delayed_link(kind="netem")``).

    Raises:
        RuntimeError: a namespace or link could not be made (see :func:`unavailable`).
    """
    return delayed_link(delay_ms, subnet, kind="netem")


@contextmanager
def delayed_link(delay_ms: float = 0.0, subnet: int | None = None, kind: str = "auto") -> Iterator[Link]:
    """Two namespaces joined by a link with ``delay_ms`` of delay each way (removed on exit).

    ``kind``: ``"auto"`` uses netem where the kernel has it, else the TUN relay; ``"netem"``
    only netem (no delay where it is missing, :attr:`Link.netem_error` says why);
    ``"tun-relay"`` always the relay (also with no delay: to measure the relay itself). The
    relay dies with the thread that entered this, so enter it from one that outlives the block.

    Raises:
        ValueError: ``kind`` is not one of :data:`KINDS`, or ``delay_ms`` is negative.
        RuntimeError: a namespace, link or the relay could not be made (see
            :func:`unavailable`, :func:`tun_unavailable`).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    if delay_ms < 0:
        raise ValueError(f"delay_ms must be >= 0, not {delay_ms}")
    serial = next(_SERIAL)  # links alive at once in one process get names of their own
    tag = f"sr{os.getpid() % 100000}x{serial % 100}"
    ns = (f"{tag}a", f"{tag}b")
    n = subnet if subnet is not None else 1 + (os.getpid() + serial) % 250
    addr = (f"10.213.{n}.1", f"10.213.{n}.2")
    veth = (f"v{tag}a", f"v{tag}b")
    relay: subprocess.Popen | None = None
    try:
        for name in ns:
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        error = ""
        if kind != "tun-relay":
            _add_veth(ns, veth, addr)
            if delay_ms > 0:
                error = _netem(ns[0], veth[0], delay_ms) or _netem(ns[1], veth[1], delay_ms)
        if kind == "tun-relay" or (kind == "auto" and error):
            if kind != "tun-relay":
                _ip("-n", ns[0], "link", "del", veth[0])  # and so its peer
            tun = (f"t{tag}a", f"t{tag}b")
            relay = _start_relay(ns, tun, addr, delay_ms)
            live = Link(ns, addr, tun, delay_ms, error, "tun-relay", relay.pid)
        else:
            netem = delay_ms > 0 and not error
            live = Link(ns, addr, veth, delay_ms if netem else 0.0, error, "netem" if netem else "none")
        yield live
    finally:
        if relay is not None:
            _stop_relay(relay)
        for name in ns:  # deleting a namespace deletes its devices, and so the veth pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", veth[0]], capture_output=True, check=False)


@dataclass(frozen=True)
class Hosts:
    """Live hosts of :func:`hosts`: namespace (also the host name :func:`enter` gives) and
    address of each, the interface every host has (``eth0``), and the delay in place on the
    links of ``delayed`` hosts."""

    namespaces: tuple[str, ...]
    addresses: tuple[str, ...]
    hub: str  # the namespace of the bridge and router
    delayed: tuple[int, ...]
    delay_ms: float  # the one-way delay on each delayed host's link (0 when none)
    delay_kind: str  # "netem", "tun-relay" or "none"
    netem_error: str  # why netem could not be used ('' when it was, or was not tried)
    ifname: str = "eth0"
    relay_pids: tuple[int, ...] = ()  # the TUN relays' process ids (none: no relay)


@contextmanager
def hosts(count: int, delay_ms: float = 0.0, delayed: tuple[int, ...] = (), subnet: int | None = None,
          kind: str = "auto") -> Iterator[Hosts]:
    """``count`` namespaces on one routed network (see the module's picture), ``delay_ms`` of
    delay each way on the links of the hosts in ``delayed``; everything is removed on exit,
    also after an error. ``kind`` as in :func:`delayed_link`. The relays die with the thread
    that entered this.

    Raises:
        ValueError: ``kind`` is unknown, ``delay_ms`` negative, ``count`` not in 1..100, or
            ``delayed`` names no host.
        RuntimeError: a namespace, link or relay could not be made (see :func:`unavailable`).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    if delay_ms < 0 or not 1 <= count <= 100 or any(not 0 <= i < count for i in delayed):
        raise ValueError(f"hosts({count}, delay_ms={delay_ms}, delayed={delayed}): out of range")
    serial = next(_SERIAL)
    tag = f"sr{os.getpid() % 100000}y{serial % 100}"
    n = subnet if subnet is not None else 1 + (os.getpid() + serial) % 250
    hub, names = f"{tag}h", tuple(f"{tag}{i}" for i in range(count))
    relays: list[subprocess.Popen] = []
    made: list[str] = []
    made_etc: list[Path] = []
    try:
        for name in (hub, *names):
            _ip("netns", "add", name)
            made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "addr", "add", f"10.214.{n}.254/24", "dev", "br0")
        _ip("-n", hub, "link", "set", "br0", "up")
        _forward(hub)
        want = delayed if delay_ms > 0 else ()
        error = "" if kind != "tun-relay" or not want else "tun-relay asked"
        addresses = []
        for i, name in enumerate(names):
            _bridge_port(hub, name, f"{tag}p{i}", f"10.214.{n}.{i + 1}", f"10.214.{n}.254")
            addresses.append(f"10.214.{n}.{i + 1}")
            if i in want and kind != "tun-relay":
                error = error or _netem(name, "eth0", delay_ms) or _netem(hub, f"{tag}p{i}", delay_ms)
        relay = bool(want) and (kind == "tun-relay" or (kind == "auto" and bool(error)))
        if relay:
            for i in want:  # the veth goes; the relay takes its place, on another subnet
                _ip("-n", names[i], "link", "del", "eth0")
                addresses[i] = f"10.215.{n}.{i + 1}"
                relays.append(_start_relay((names[i], hub), ("eth0", f"t{tag}{i}"),
                                           (addresses[i], f"10.215.{n}.{i + 128}"), delay_ms))
                _ip("-n", names[i], "route", "add", "default", "dev", "eth0")
        delay_kind = "tun-relay" if relay else "netem" if want and not error else "none"
        _hosts_files(names, addresses, made_etc)
        yield Hosts(names, tuple(addresses), hub, tuple(want), delay_ms if delay_kind != "none" else 0.0,
                    delay_kind, error, relay_pids=tuple(proc.pid for proc in relays))
    finally:
        for proc in relays:
            _stop_relay(proc)
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        for path in made_etc:  # the hosts' directories, then /etc/netns when it was made here
            if path == _ETC_NETNS:
                with contextlib.suppress(OSError):
                    path.rmdir()
            else:
                shutil.rmtree(path, ignore_errors=True)


_ETC_NETNS = Path("/etc/netns")


def _hosts_files(names: tuple[str, ...], addresses: list[str], made: list[Path]) -> None:
    """``/etc/netns/<name>/hosts`` for every host, naming every host, so that host names
    resolve as on a real network (``ip netns exec`` mounts it on /etc/hosts); what was made
    goes into ``made``, in the order to remove it."""
    if not _ETC_NETNS.exists():
        made.append(_ETC_NETNS)
    table = "127.0.0.1 localhost\n::1 localhost\n"
    table += "".join(f"{a} {n}\n" for n, a in zip(names, addresses, strict=True))
    for name in names:
        (_ETC_NETNS / name).mkdir(parents=True, exist_ok=True)
        made.insert(0, _ETC_NETNS / name)
        (_ETC_NETNS / name / "hosts").write_text(table)


def _forward(namespace: str) -> None:
    """Let ``namespace`` route between its interfaces (its own sysctl)."""
    proc = subprocess.run(["ip", "netns", "exec", namespace, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"sysctl net.ipv4.ip_forward=1 in {namespace}: {proc.stderr.strip()}")


def _bridge_port(hub: str, host: str, port: str, address: str, gateway: str) -> None:
    """A veth from ``host`` (named ``eth0`` there, with ``address``) to the hub's bridge."""
    _ip("-n", hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", host)
    _ip("-n", hub, "link", "set", port, "master", "br0", "up")
    _ip("-n", host, "addr", "add", f"{address}/24", "dev", "eth0")
    _ip("-n", host, "link", "set", "eth0", "up")
    _ip("-n", host, "route", "add", "default", "via", gateway)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (0.0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _add_veth(ns: tuple[str, str], dev: tuple[str, str], addr: tuple[str, str]) -> None:
    _ip("link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
    for name, d, a in zip(ns, dev, addr, strict=True):
        _ip("link", "set", d, "netns", name)
        _ip("-n", name, "addr", "add", f"{a}/24", "dev", d)
        _ip("-n", name, "link", "set", d, "up")


def _start_relay(ns: tuple[str, str], dev: tuple[str, str], addr: tuple[str, str],
                 delay_ms: float) -> subprocess.Popen:
    """Start ``tunrelay.py`` (which makes the two TUN devices), then address them point to point."""
    proc = subprocess.Popen([sys.executable, str(_RELAY), *ns, *dev, repr(float(delay_ms)), str(os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], _RELAY_START_S)
        if not ready or proc.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the TUN relay did not start: {_stop_relay(proc) or 'no message'}")
        for name, d, a, peer in zip(ns, dev, addr, addr[::-1], strict=True):
            _ip("-n", name, "addr", "add", a, "peer", peer, "dev", d)
            # no IPv6 link-local address: its router solicitations would only cross the relay
            _ip("-n", name, "link", "set", d, "addrgenmode", "none")
            _ip("-n", name, "link", "set", d, "mtu", str(_RELAY_MTU), "txqueuelen", "10000", "up")
    except BaseException:
        _stop_relay(proc)
        raise
    return proc


def _stop_relay(proc: subprocess.Popen) -> str:
    """End the relay (end of file on its stdin, else SIGKILL); returns what it wrote to stderr."""
    if proc.returncode is None:
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
    if proc.stderr is None or proc.stderr.closed:
        return ""  # stopped before
    err = proc.stderr.read().decode(errors="replace").strip()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    if err:
        print(err, file=sys.stderr)
    return err


def enter(namespace: str) -> None:
    """Move this process into ``namespace`` (before it opens any socket), under a host
    name of its own (``namespace``, in a new UTS namespace), so it looks like another
    host: same-host shortcuts keyed on the host name (shardreplay's shared-memory
    exchange) stay off and data crosses the link.

    Raises:
        OSError: setns or unshare failed (not root, or no such namespace).
    """
    enter_net(namespace)
    _own_host_name(namespace)


def _own_host_name(name: str) -> None:
    """Give this process a UTS namespace of its own, with host name ``name``."""
    libc = ctypes.CDLL(None, use_errno=True)
    _check(libc.unshare(_CLONE_NEWUTS), "unshare(CLONE_NEWUTS)")
    socket.sethostname(name)


def enter_net(namespace: str) -> None:
    """Move this thread into network namespace ``namespace`` (the sockets it opens from then
    on are in there; the host name stays).

    Raises:
        OSError: setns failed (not root, or no such namespace).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(_NETNS_DIR, namespace), os.O_RDONLY)
    try:
        _check(libc.setns(fd, _CLONE_NEWNET), f"setns into {namespace}")
    finally:
        os.close(fd)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def main(argv: list[str]) -> int:
    """``exec NAMESPACE COMMAND...``: run COMMAND in NAMESPACE under its own host name, through
    ``ip netns exec`` (which also puts ``/etc/netns/NAMESPACE/hosts`` in place of /etc/hosts)."""
    if len(argv) >= 3 and argv[0] == "exec":
        os.execvp("ip", ["ip", "netns", "exec", argv[1], sys.executable, __file__, "named", *argv[1:]])
    if len(argv) >= 3 and argv[0] == "named":  # already in the namespace: the host name, then COMMAND
        _own_host_name(argv[1])
        os.execvp(argv[2], argv[2:])
    print("usage: python netns.py exec NAMESPACE COMMAND [ARGS...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
