"""Two Linux network namespaces joined by a veth pair, for ranks that talk over a link.

:func:`veth_pair` creates namespaces ``<prefix>a`` and ``<prefix>b``, a veth pair with one
end in each (``10.213.<n>.1`` and ``.2``, /24, private addresses), brings the links up and,
when asked, puts a ``tc netem`` delay on both ends (one way each: the round trip gets twice
it). Everything is removed on the way out, also after an error. A process (a rank) moves
itself into one with :func:`enter` before it opens any socket. Needs root (CAP_NET_ADMIN
and CAP_SYS_ADMIN) and the ``ip`` tool; netem needs the ``sch_netem`` kernel module, which
some kernels lack: then the pair works without delay and :attr:`Link.netem_error` says why.

Usage::

    with veth_pair(delay_ms=0.25) as link:
        ...  # rank r: enter(link.namespaces[r]); connect to link.addresses[0]
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUTS = 0x04000000
_NETNS_DIR = "/var/run/netns"


@dataclass(frozen=True)
class Link:
    """A live veth pair: namespace, address and interface of each end."""

    namespaces: tuple[str, str]
    addresses: tuple[str, str]
    ifnames: tuple[str, str]
    delay_ms: float  # the netem delay in place on each end (0 when none could be set)
    netem_error: str  # why the asked-for delay is not in place ('' when it is, or none was asked)


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


@contextmanager
def veth_pair(delay_ms: float = 0.0, subnet: int | None = None) -> Iterator[Link]:
    """Two namespaces joined by a veth pair, with a netem delay of ``delay_ms`` on each end
    when the kernel has netem (removed on exit).

    Raises:
        RuntimeError: a namespace or link could not be made (see :func:`unavailable`).
    """
    tag = f"sr{os.getpid() % 100000}"
    ns = (f"{tag}a", f"{tag}b")
    dev = (f"v{tag}a", f"v{tag}b")
    n = subnet if subnet is not None else 1 + os.getpid() % 250
    addr = (f"10.213.{n}.1", f"10.213.{n}.2")
    error = ""
    try:
        for name in ns:
            _ip("netns", "add", name)
        _ip("link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
        for name, d, a in zip(ns, dev, addr, strict=True):
            _ip("link", "set", d, "netns", name)
            _ip("-n", name, "addr", "add", f"{a}/24", "dev", d)
            _ip("-n", name, "link", "set", d, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        if delay_ms > 0:
            error = _netem(ns[0], dev[0], delay_ms) or _netem(ns[1], dev[1], delay_ms)
        yield Link(ns, addr, dev, delay_ms if delay_ms > 0 and not error else 0.0, error)
    finally:
        for name in ns:  # deleting a namespace deletes its end of the pair, and so the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", dev[0]], capture_output=True, check=False)


def enter(namespace: str) -> None:
    """Move this process into ``namespace`` (before it opens any socket), under a host
    name of its own (``namespace``, in a new UTS namespace), so it looks like another
    host: same-host shortcuts keyed on the host name (shardreplay's shared-memory
    exchange) stay off and data crosses the link.

    Raises:
        OSError: setns or unshare failed (not root, or no such namespace).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(_NETNS_DIR, namespace), os.O_RDONLY)
    try:
        _check(libc.setns(fd, _CLONE_NEWNET), f"setns into {namespace}")
    finally:
        os.close(fd)
    _check(libc.unshare(_CLONE_NEWUTS), "unshare(CLONE_NEWUTS)")
    socket.sethostname(namespace)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
