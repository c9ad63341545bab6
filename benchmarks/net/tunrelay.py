"""A delay link in a process: netem's ``delay`` for kernels without ``sch_netem``.

Run as a program (``python tunrelay.py NS_A NS_B IF_A IF_B DELAY_MS``), it creates a TUN
device ``IF_A`` in network namespace ``NS_A`` and ``IF_B`` in ``NS_B`` (both live as long as
this process holds them), prints ``ready`` and then relays: every IP packet the kernel sends
out of one device is written, unchanged, into the other one ``DELAY_MS`` ms after it was read.
Each direction is a FIFO queue stamped with the time each packet is due, so a packet never
overtakes another of its direction and a wait in one direction never holds up the other::

    ns A: send -> IF_A --read--> [queue A->B: (due, packet), ...] --write at due--> IF_B -> ns B
    ns B: send -> IF_B --read--> [queue B->A: (due, packet), ...] --write at due--> IF_A -> ns A

The caller (:func:`netns.link`) gives the devices their addresses and brings them up. The
relay ends when its standard input reaches end of file (the caller closed it, or died) and,
through ``PR_SET_PDEATHSIG``, when the thread that started it ends: it never outlives its
caller. It waits in ``select`` (microsecond timeouts; ``epoll`` rounds up to whole
milliseconds) with a 1 ns timer slack, at a raised priority where allowed, because a
loaded machine delays its wake-ups (netem runs in the kernel's softirq, above every
process): what it adds on top of the asked delay is measured by ``linkprobe.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import select
import signal
import struct
import sys
import time
from collections import deque

_CLONE_NEWNET = 0x40000000
_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_PR_SET_PDEATHSIG, _PR_SET_TIMERSLACK = 1, 29
_READ_BYTES = 65536  # above any MTU a TUN device can have, so a read never cuts a packet
_READS_PER_TURN = 64  # per device and wake-up, so a flood one way cannot starve the other


def open_tun(namespace: str, ifname: str) -> int:
    """Create TUN device ``ifname`` (IP packets, no header) in ``namespace``; returns its fd
    (non-blocking). The device is removed when the fd is closed.

    Raises:
        OSError: not root, no such namespace, no ``/dev/net/tun``, or the name is taken.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    ns_fd = os.open(os.path.join("/var/run/netns", namespace), os.O_RDONLY)
    try:
        if libc.setns(ns_fd, _CLONE_NEWNET) != 0:  # the device is made in the opener's namespace
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {namespace}: {os.strerror(err)}")
    finally:
        os.close(ns_fd)
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", ifname.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def relay(fds: tuple[int, int], delay_s: float, control_fd: int) -> int:
    """Move packets between the two TUN fds, each ``delay_s`` late, until ``control_fd``
    reads end of file; returns the number of packets the kernel refused (0 normally)."""
    queues: tuple[deque, deque] = (deque(), deque())  # queues[i]: read from fds[i], for fds[1 - i]
    refused = 0
    watched = [fds[0], fds[1], control_fd]
    while True:
        now = time.monotonic()
        for i in (0, 1):
            q = queues[i]
            while q and q[0][0] <= now:
                try:
                    os.write(fds[1 - i], q[0][1])
                except BlockingIOError:
                    break  # retried on the next turn, keeping the order
                except OSError as exc:  # e.g. the device is not up yet: a wire would lose it too
                    refused += 1
                    if refused == 1:  # one line, not one per packet: the caller reads stderr at the end
                        print(f"tunrelay: a packet was refused: {exc}", file=sys.stderr, flush=True)
                q.popleft()
        due = [q[0][0] for q in queues if q]
        timeout = max(0.0, min(due) - time.monotonic()) if due else None
        if due and any(q and q[0][0] <= now for q in queues):
            timeout = 0.0005  # a device refused a write for now (full): try again shortly
        readable, _, _ = select.select(watched, [], [], timeout)
        if control_fd in readable and not os.read(control_fd, 4096):
            return refused
        for i in (0, 1):
            if fds[i] not in readable:
                continue
            for _ in range(_READS_PER_TURN):
                try:
                    packet = os.read(fds[i], _READ_BYTES)
                except BlockingIOError:
                    break
                queues[i].append((time.monotonic() + delay_s, packet))


def _prepare(parent_pid: int) -> None:
    """Die with the caller; wake up on time."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the caller died before the line above took effect
        sys.exit(1)
    libc.prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    with contextlib.suppress(OSError):  # not allowed: normal priority (the measured latency shows it)
        os.setpriority(os.PRIO_PROCESS, 0, -5)


def main(argv: list[str]) -> int:
    """The program: ``NS_A NS_B IF_A IF_B DELAY_MS PARENT_PID``."""
    ns_a, ns_b, if_a, if_b, delay_ms, parent_pid = argv
    _prepare(int(parent_pid))
    try:
        fds = (open_tun(ns_a, if_a), open_tun(ns_b, if_b))
    except OSError as exc:
        print(f"tunrelay: cannot create the TUN devices: {exc}", file=sys.stderr, flush=True)
        return 2
    print("ready", flush=True)
    refused = relay(fds, float(delay_ms) / 1e3, sys.stdin.fileno())
    if refused:
        print(f"tunrelay: {refused} packets refused in all", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
