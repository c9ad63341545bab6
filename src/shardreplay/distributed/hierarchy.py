"""Collectives of an exchange group whose ranks span several hosts (docs/multi-machine.md,
"Across hosts"). An all_to_all takes four hops: a host's ranks show each other their sizes
through shared memory (:class:`SameHost`), then send each other their sections and their
host's leader (its first rank) all bound for other hosts; the leaders exchange one message
per pair of hosts over a gloo group of theirs (one round trip); each hands its host's ranks
what came for them. A rank that sees the group break (a peer ended, a connection closed)
leaves it, letting its region's lock and its leader's connections go: the ranks waiting on
it learn it at once (``PeerLost``), not after the timeout.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import numpy as np

from shardreplay.distributed.same_host import SameHost

_NONE = np.empty(0, np.uint8)


def host_groups(keys: Any) -> list[list[int]]:
    """The ranks of each host (equal host ``keys``), hosts in the order of their first rank."""
    hosts: dict[int, list[int]] = {}
    for rank, key in enumerate(np.asarray(keys).reshape(-1).tolist()):
        hosts.setdefault(key, []).append(rank)
    return list(hosts.values())


def _split(buf: np.ndarray, sizes: Any) -> list[np.ndarray]:
    return np.split(buf, np.cumsum(sizes)[:-1])


def _joined(parts: list[list[np.ndarray]]) -> tuple[np.ndarray, list[int]]:
    return np.concatenate([_NONE, *(p for ps in parts for p in ps)]), [sum(map(len, ps)) for ps in parts]


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

    def post(self, recv: np.ndarray, send: np.ndarray, send_sizes: list[int],
             recv_sizes: list[int]) -> Hierarchy:
        """Start an all_to_all of bytes (as :meth:`SameHost.post`): the sizes to this host's ranks."""
        self._op, row = (recv, send, send_sizes), np.array([*send_sizes, *recv_sizes]).view(np.uint8)
        self._got = np.empty(self.local.world * row.size, np.uint8)
        self.local.post(self._got, *_joined([[row]] * self.local.world), [row.size] * self.local.world)
        return self

    def wait(self, timeout: datetime.timedelta) -> bool:
        """Run the all_to_all posted to the end (False: ``timeout`` passed first).

        Raises:
            RuntimeError: as :meth:`SameHost.wait`'s or the leaders' backend's (but a
                timeout's: this rank then leaves the group).
        """
        deadline = time.monotonic() + timeout.total_seconds()
        try:
            self._exchange(self._hop(None, [self._got.size], deadline)[0], deadline)
        except TimeoutError:  # a wait's deadline passed
            return False
        except RuntimeError as exc:  # PeerLost too
            if not any(word in str(exc).lower() for word in ("timed out", "timeout")):
                self.close(leave=True)
            raise
        return True

    def _exchange(self, sizes: np.ndarray, deadline: float) -> None:
        (recv, send, send_sizes), mine, remote = self._op, self.mine, self.remote
        n, me = self.local.world, self.local.rank
        out, into = sizes.view(np.int64).reshape(n, 2, -1).transpose(1, 0, 2)  # [local, rank]: bytes
        pieces = _split(send, send_sizes)
        parts = [[pieces[t]] for t in mine]
        parts[0] += [pieces[t] for t in remote]  # the leader's: all bound for other hosts
        got = self._hop(parts, out[:, mine[me]] + (out[:, remote].sum(1) if me == 0 else 0), deadline)
        own = [g[:out[i, mine[me]]] for i, g in enumerate(got)]  # from mine[i] to this rank
        parts = [[] for _ in mine]
        if me == 0:
            came = self._across([_split(g[out[i, mine[0]]:], out[i, remote]) for i, g in enumerate(got)],
                                into, deadline)
            parts = [[came[s, j] for s in remote] for j in range(n)]
        got = self._hop(parts, np.array([into[me, remote].sum()] + [0] * (n - 1)), deadline)
        theirs = dict(zip(remote, _split(got[0], into[me, remote]), strict=True))
        at = {r: i for i, r in enumerate(mine)}
        np.concatenate([_NONE] + [own[at[s]] if s in at else theirs[s] for s in range(len(pieces))], out=recv)

    def _across(self, bound: list[list[np.ndarray]], into: np.ndarray,
                deadline: float) -> dict[tuple[int, int], np.ndarray]:
        """The leaders' all_to_all: to each other host, what this host's ranks send its ranks
        (``bound[i]``: rank ``mine[i]``'s, in the order of ``remote``); what came from each
        other rank ``s`` for local rank ``j``, by ``(s, j)``."""
        at = {r: i for i, r in enumerate(self.remote)}
        mine, n = self.mine, len(self.mine)
        send, send_sizes = _joined([[] if h is mine else [bound[i][at[t]] for i in range(n) for t in h]
                                    for h in self.hosts])
        sizes = [int(into[:, h].sum()) if h is not mine else 0 for h in self.hosts]
        recv = np.empty(sum(sizes), np.uint8)
        if self.leaders.post(recv, send, sizes, send_sizes).wait(timeout=_left(deadline)) is False:
            raise TimeoutError
        order = [(s, j) for h in self.hosts if h is not mine for s in h for j in range(n)]
        return dict(zip(order, _split(recv, [into[j, s] for s, j in order]), strict=True))

    def _hop(self, parts: list[list[np.ndarray]] | None, sizes: Any, deadline: float) -> list[np.ndarray]:
        """One all_to_all among this host's ranks: ``parts[j]`` to local rank ``j``, ``sizes[i]``
        bytes from ``i`` (None: the one :meth:`post` began); what came, by rank."""
        if parts is not None:
            self._got = np.empty(int(np.sum(sizes)), np.uint8)
            self.local.post(self._got, *_joined(parts), [int(s) for s in sizes])
        if not self.local.wait(_left(deadline)):
            raise TimeoutError
        return _split(self._got, sizes)

    def close(self, leave: bool = False) -> None:
        """Let the leaders' group and the region go (``leave``: only its lock, its peers see it end)."""
        self.local.leave() if leave else self.local.close()
        leaders, self.leaders = self.leaders, None
        if leaders is not None:
            leaders.close()
