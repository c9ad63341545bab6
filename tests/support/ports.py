"""Free loopback ports that do not race between pytest-xdist workers.

A port found by binding port 0 and closing comes from the kernel's ephemeral range, where
any other worker's probe or outgoing connection may be handed the same number before the
server binds it. Instead each worker draws from a slice of its own below that range
(``ip_local_port_range`` starts at 32768), so two workers never offer the same port, and
the kernel never gives it to an outgoing connection; a bind probe skips ports in use.
"""

from __future__ import annotations

import itertools
import os
import re
import socket

_LOW, _SLICE, _SLICES = 20_000, 1_000, 12  # ports 20000-31999: under the ephemeral range


def _worker_index() -> int:
    """This xdist worker's number (``gw3`` -> 3); 0 outside xdist."""
    match = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    return int(match.group(1)) if match else 0


def _candidates() -> itertools.cycle[int]:
    """This worker's slice, from an offset of this process's own (other sessions and the
    processes a test starts each walk the slice from elsewhere)."""
    first = _LOW + (_worker_index() % _SLICES) * _SLICE
    ports = list(range(first, first + _SLICE))
    start = (os.getpid() * 7919) % _SLICE
    return itertools.cycle(ports[start:] + ports[:start])


_NEXT = _candidates()
_PID = os.getpid()


def _bindable(port: int) -> bool:
    """Nothing listens on or holds ``port`` on any local address (no SO_REUSEADDR: a port
    in TIME_WAIT counts as taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that no other xdist worker offers.

    Raises:
        RuntimeError: every port of this worker's slice is taken.
    """
    global _NEXT, _PID
    if os.getpid() != _PID:  # a forked child: walk from an offset of its own
        _NEXT, _PID = _candidates(), os.getpid()
    for _ in range(_SLICE):
        port = next(_NEXT)
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port in {_SLICE} tries (worker {_worker_index()}): too many servers left?")
