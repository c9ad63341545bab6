"""Collectives of an exchange group whose ranks span several hosts (docs/multi-machine.md,
"Across hosts"): a host's ranks through shared memory (:class:`SameHost`, its records areas),
one leader per host (its first rank) over a gloo group of the leaders: one message per pair of
hosts. A rank that sees the group break (a peer ended, a connection closed) leaves it, letting
its region's lock and its leader's connections go: the ranks waiting on it learn it at once.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import numpy as np

from shardreplay.distributed.same_host import SameHost


def host_groups(keys: Any) -> list[list[int]]:
    """The ranks of each host (equal host ``keys``), hosts in the order of their first rank."""
    keys = np.asarray(keys).reshape(-1)
    return [np.flatnonzero(keys == key).tolist() for key in dict.fromkeys(keys.tolist())]


def _split(buf: np.ndarray, sizes: Any) -> list[np.ndarray]:
    return np.split(buf, np.cumsum(sizes)[:-1])


def _left(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.0, deadline - time.monotonic()))


class Hierarchy:
    """This rank's end of the collectives of ranks grouped by ``hosts`` (:func:`host_groups`):
    ``local`` among its host's ranks (joined); ``leaders`` on a host's first rank (else None):
    ``post(recv, send, recv_sizes, send_sizes)``, the leaders' all_to_all of bytes, and ``close()``."""

    def __init__(self, local: SameHost, hosts: list[list[int]], rank: int, leaders: Any) -> None:
        self.local, self.hosts, self.leaders = local, hosts, leaders
        self.mine = next(h for h in hosts if rank in h)
        self.remote = sorted(r for h in hosts if h is not self.mine for r in h)
        self._at = local.world, local.rank

    def post(self, recv: np.ndarray, send: np.ndarray, send_sizes: list[int],
             recv_sizes: list[int]) -> Hierarchy:
        """Start an all_to_all of bytes (as :meth:`SameHost.post`): docs/multi-machine.md's 4 steps."""
        self._op, row = (recv, send, recv_sizes), np.array([*send_sizes, *recv_sizes]).view(np.uint8)
        if self.local.rank:  # there until every rank of the host has read it (the next post)
            self._area(self.local.rank, send.size)[:] = send
        self._got = np.empty(self.local.world * row.size, np.uint8)
        self.local.post(self._got, np.tile(row, self.local.world), *[[row.size] * self.local.world] * 2)
        return self

    def wait(self, timeout: datetime.timedelta) -> bool:
        """Run the all_to_all posted to the end (False: ``timeout`` passed first); raises
        ``RuntimeError`` as :meth:`SameHost.wait` or the leaders' backend (then, but for a
        timeout, this rank leaves the group)."""
        deadline = time.monotonic() + timeout.total_seconds()
        try:
            self._hop(deadline)
            self._exchange(deadline)
        except TimeoutError:  # a wait's deadline passed
            return False
        except RuntimeError as exc:  # PeerLost too
            if not any(word in str(exc).lower() for word in ("timed out", "timeout")):
                self.close(leave=True)
            raise
        return True

    def _exchange(self, deadline: float) -> None:
        (recv, send, recv_sizes), mine, remote, n, me = self._op, self.mine, self.remote, *self._at
        out, into = self._got.view(np.int64).reshape(n, 2, -1).transpose(1, 0, 2)  # [local, rank]: bytes
        starts, slots = np.cumsum(out, axis=1) - out, _split(recv, recv_sizes)
        areas = [send, *(self._area(i, int(out[i].sum())) for i in range(1, n))]

        def section(i: int, t: int) -> np.ndarray:  # what mine[i] sends rank t
            return areas[i][starts[i, t]:starts[i, t] + out[i, t]]
        for i in range(1 if me else 0, n):  # the leader's comes with the rest, from its area
            slots[mine[i]][:] = section(i, mine[me])
        blocks = np.cumsum([0, *(out[0, mine[1:]] + into[1:, remote].sum(1))])  # in the leader's area
        if me == 0:
            came = self._across(section, out, into, deadline)
            for s in remote:
                slots[s][:] = came[s, 0]
            area = self._area(0, int(blocks[-1]))
            for j in range(1, n):
                parts = [section(0, mine[j]), *(came[s, j] for s in remote)]
                np.concatenate(parts, out=area[blocks[j - 1]:blocks[j]])
        self._hop(deadline, shown=False)
        if me:
            got = self._area(0, int(blocks[-1]))[blocks[me - 1]:blocks[me]]
            for s, part in zip([mine[0], *remote], _split(got, into[me, [mine[0], *remote]]), strict=True):
                slots[s][:] = part

    def _across(self, section: Any, out: np.ndarray, into: np.ndarray,
                deadline: float) -> dict[tuple[int, int], np.ndarray]:
        """To each other host what this host's ranks send it; what came from ``s`` for ``j`` by ``(s, j)``."""
        mine, n = self.mine, len(self.mine)
        send = np.concatenate([np.empty(0, np.uint8), *(section(i, t) for h in self.hosts if h is not mine
                                                         for i in range(n) for t in h)])
        sizes = [[int(m[:, h].sum()) if h is not mine else 0 for h in self.hosts] for m in (out, into)]
        recv = np.empty(sum(sizes[1]), np.uint8)
        if self.leaders.post(recv, send, *sizes).wait(timeout=_left(deadline)) is False:
            raise TimeoutError
        order = [(s, j) for h in self.hosts if h is not mine for s in h for j in range(n)]
        return dict(zip(order, _split(recv, [into[j, s] for s, j in order]), strict=True))

    def _hop(self, deadline: float, shown: bool = True) -> None:
        """Wait for this host's ranks' sizes (:meth:`post`), or (not ``shown``) for them all to arrive."""
        if not shown:
            self.local.post(np.empty(0, np.uint8), np.empty(0, np.uint8), *[[0] * self.local.world] * 2)
        if not self.local.wait(_left(deadline)):
            raise TimeoutError

    def _area(self, rank: int, nbytes: int) -> np.ndarray:
        """``nbytes`` of ``rank``'s records area (mapped in powers of two, alike on every rank)."""
        return self.local.records(rank, 1 << max(16, (nbytes - 1).bit_length()))[:nbytes]

    def close(self, leave: bool = False) -> None:
        """Let the leaders' group and the region go (``leave``: only its lock, its peers see it end)."""
        if leave:
            self.local.leave()
        else:
            self.local.close()
        leaders, self.leaders = self.leaders, None
        if leaders is not None:
            leaders.close()
