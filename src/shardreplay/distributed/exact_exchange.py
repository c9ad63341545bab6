"""Exact-mode refills: every rank's batches drawn from the global distribution, each item
fetched from the shard that owns it.

Every rank derives every requester's shard counts from one shared seed, so only the data
is exchanged: each owner writes the windows every requester drew from it (its own
included) into packed records, in a send buffer for ``all_to_all`` or on one host in its
region in ``/dev/shm`` (:class:`SharedRecords`), and sends its shard's new figures with
them (docs/semantics.md, "Sharded sampling").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from shardreplay.buffer.shard import Shard
from shardreplay.distributed.exchange import Drawn, ExchangeStats, split_batches
from shardreplay.distributed.group import Collectives, Released
from shardreplay.distributed.same_host import SameHost
from shardreplay.errors import EmptyBufferError
from shardreplay.kernels import exchange as kernels
from shardreplay.spec.layout import DATA, RecordLayout

_LOG = logging.getLogger(__name__)


class ExactExchange:
    """The exchange strategy of ``mode="exact"``: draws a rank's prefetched batches from
    the global distribution (collective: one all_to_all of records, or when ``comm`` runs
    through shared memory one all_gather, the records in the ranks' regions; and all of it
    again when a batch is short of its count).

    ``pin`` draws into page-locked memory (batches go to a GPU: one non-blocking copy per batch).
    """

    agree_every = 1  # its draw is collective: every exchange agrees

    def __init__(self, local: Shard, comm: Collectives, layout: RecordLayout, pin: bool = False) -> None:
        self.local = local
        self._comm = comm
        self._layout = layout
        self._data_at = layout.offsets(DATA)
        at = layout.offsets()
        self._columns_at = np.array([at["mask"], at["key"], at["probability"]], np.int64)
        self.rank, self.world_size = comm.rank, comm.world_size
        self._pin = pin
        self._widen = 1e-3  # how far the counts' CDF may move while routed updates land (see draw)
        # None: all_to_all (other hosts, or a region that could not grow, alike on every rank).
        self._shared = SharedRecords(comm.same_host, layout.record_bytes) if comm.same_host else None

    def start(self, n: int, k: int) -> Callable[[], None] | None:
        """Work to overlap with the stats exchange: none (the draw needs every rank's counts)."""
        return None

    def draw(self, stats: ExchangeStats, n: int, k: int, early: Any = None,
             released: Released | None = None) -> list[Drawn]:
        """``k`` batches of ``n`` windows for this rank, from every rank's ``stats`` (the
        same on every rank: masses, batch sizes, and rank 0's seed).

        Each of a requester's ``k`` batches takes Multinomial(n, mass/total) items from the
        shards (:func:`kernels.exchange.counts`), each drawn from its shard: ``n`` i.i.d. draws from the
        global distribution, with the masses the owners send with the records. After routed
        updates (``stats.tail``) each owner also draws the items of the uniforms within
        ``_widen`` (twice the CDF's last move) of its share; a batch still short makes the
        ranks draw again (docs/semantics.md, "Sharded sampling").

        Raises:
            EmptyBufferError: every shard's new mass is 0 (on every rank alike).
            CollectiveTimeout: a peer rank did not join in time.
        """
        u = kernels.uniforms(int(stats.seed[0]), (self.world_size, k, int(stats.batch_size.max())))
        return self._exchange(stats.mass, stats.batch_size, u, k, bool(stats.tail.any()), released)

    def _exchange(self, masses: np.ndarray, batches: np.ndarray, u: np.ndarray, k: int, spare: bool,
                  released: Released | None, again: bool = False) -> list[Drawn]:
        """One records collective (see :meth:`draw`): each owner draws ``planned`` items per
        requester and batch (``spare``: more than ``masses`` give) and sends them with its
        ``[written, mass, min leaf, max priority]``; ``again``: the counts of ``masses`` are final."""
        me, rb, n = self.rank, self._layout.record_bytes, int(batches[self.rank])
        if not masses.sum() > 0:
            raise EmptyBufferError("no shard has a window to sample: write more steps first")
        shared = self._shared
        head = 0 if shared is not None else -(-32 // rb)  # rows before each all_to_all section: post
        planned, sizes, rows = kernels.plan(masses, batches, u, self._widen if spare else 0.0, me, head)
        owner_rows, sent, firsts, peer_first, mine = sizes  # planned[requester, batch, owner]
        if shared is not None:
            shared.plan(owner_rows)
        send = self._send_buffer(shared, int(owner_rows[me]) + head * self.world_size)
        st = self.local.stats()
        post = np.array([send is not None, st.mass, st.min_leaf, self.local.max_priority], np.float64)
        if send is not None and st.mass > 0 and rows.size:
            draw = self.local.draw(rows.size, advance_schedule=False)
            mask, keys = self.local.gather(draw.starts, into=(send, self._data_at, rows))
            kernels.write_columns(send, rows, mask.view(np.uint8), keys, me, draw.probabilities, st.mass,
                                  self._columns_at)  # q * mass: divided by the total below
        if shared is not None:
            posts = self._comm.all_gather(post, "ShardedReplayBuffer.sample(records written)",
                                          released=released)
        else:
            assert send is not None
            for first in firsts:
                send[first - head:first].reshape(-1)[:32] = post.view(np.uint8)
            recv = self._comm.all_to_all(send.reshape(-1), ((sent + head) * rb).tolist(),
                                         ((mine + head) * rb).tolist(), "ShardedReplayBuffer.sample(records)",
                                         released=released)
            sections = np.split(recv.reshape(-1, rb), np.cumsum(mine + head)[:-1])
            posts = np.stack([s[:head].reshape(-1)[:32].view(np.float64) for s in sections])
            sources = [s[head:] for s in sections]
        code, final, self._widen, low, top = kernels.settle(
            posts, masses, planned, batches, u, self._widen, spare, again)
        if code != kernels.DONE:  # alike on every rank: all see every post
            if code == kernels.FALLBACK:
                self._shared = None
            return self._exchange(posts[:, 1].copy(), batches, u, k, False, released, again=True)
        if shared is not None:  # every rank has written its area (not read before: one may have none)
            sources = [shared.area(o)[f:f + c] for o, (f, c) in enumerate(zip(peer_first, mine, strict=True))]
        self.local.raise_max_priority(top)
        total = float(posts[:, 1].sum())  # numpy's summation order, as before
        records = torch.empty((k * n, rb), dtype=torch.uint8, pin_memory=self._pin)
        out = records.numpy()
        drawn, got, at = planned[me].tolist(), final[me].tolist(), [0] * self.world_size  # [batch][owner]
        for b in range(k):  # batch b: rows b * n.. from each owner in turn; at: an owner's next drawn row
            row = b * n
            for o, m in enumerate(got[b]):
                out[row:row + m] = sources[o][at[o]:at[o] + m]
                row, at[o] = row + m, at[o] + drawn[b][o]
        views = self._layout.views(out)
        views["probability"] /= total
        return split_batches({f: views[DATA + f] for f in self._data_at}, views["mask"], views["key"],
                             views["probability"], n, total, low, 1.0, self.local.current_beta(), records)

    @property
    def uses_shared_memory(self) -> bool:
        """Whether records go through shared memory (the ranks share one host)."""
        return self._shared is not None

    def _send_buffer(self, shared: SharedRecords | None, rows: int) -> np.ndarray | None:
        """Where this rank writes the records it sends: its region (None if that failed), or an array."""
        if shared is None:
            return np.empty((rows, self._layout.record_bytes), np.uint8)
        try:
            return shared.own_region(rows)
        except OSError as exc:
            _LOG.warning("rank %d: shared-memory region failed (%s); exchanging sampled records "
                         "through the process group from now on", self.rank, exc)
            return None


class SharedRecords:
    """Every rank's records area in its same-host region (:meth:`SameHost.records`), each
    sized alike on every rank by :meth:`plan`."""

    def __init__(self, host: SameHost, record_bytes: int) -> None:
        self._host, self.rank, self.record_bytes = host, host.rank, record_bytes
        self._rows = np.zeros(host.world, np.int64)  # capacity of each rank's area, in records

    def plan(self, rows: np.ndarray) -> None:
        """Size every rank's area for ``rows[r]`` records (every rank passes the same ``rows``)."""
        self._rows = np.where(rows > self._rows, np.maximum(rows + rows // 4, 2 * self._rows), self._rows)

    def own_region(self, rows: int) -> np.ndarray:
        """This rank's area as ``[rows, record_bytes]`` uint8.

        Raises:
            OSError: it could not grow (e.g. ``/dev/shm`` is full).
        """
        return self.area(self.rank)[:rows]

    def area(self, rank: int) -> np.ndarray:
        """``rank``'s area as ``[rows, record_bytes]`` uint8 (read-only but this rank's)."""
        cap = int(self._rows[rank])
        return self._host.records(rank, cap * self.record_bytes).reshape(cap, self.record_bytes)
