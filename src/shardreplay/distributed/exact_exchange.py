"""Exact-mode refills: every rank's batches drawn from the global distribution, each item
fetched from the shard that owns it.

Every rank derives every requester's shard counts from one shared seed, so only the data
is exchanged: windows are written from storage into packed records, a rank's own into
their final rows while the others' are in flight, the others' into a send buffer for
``all_to_all``, or on one host into the owner's region in ``/dev/shm``
(:class:`SharedRecords`; docs/semantics.md, "Sharded sampling").
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import socket
import weakref
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardreplay.buffer.device import write_records
from shardreplay.buffer.shard import Shard
from shardreplay.distributed.exchange import Drawn, ExchangeStats, split_batches
from shardreplay.distributed.group import Collectives, Released
from shardreplay.spec.layout import RecordLayout, data_parts
from shardreplay.spec.torch_dtypes import torch_views

_LOG = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
_KEY_BITS = 63  # host keys and nonces are non-negative int64s


class ExactExchange:
    """The exchange strategy of ``mode="exact"``: draws a rank's prefetched batches from
    the global distribution (collective: one all_to_all of records, or on one host one
    all_gather, plus one more while the shared-memory regions are (re)mapped).

    ``hosts`` and ``nonces`` are every rank's :func:`host_key` and :func:`nonce`; ``pin``
    draws into page-locked memory (batches go to a GPU: one non-blocking copy per batch).
    """

    agree_every = 1  # its draw is collective: every exchange agrees

    def __init__(self, local: Shard, comm: Collectives, layout: RecordLayout, hosts: np.ndarray,
                 nonces: np.ndarray, pin: bool = False) -> None:
        self.local = local
        self._comm = comm
        self._layout = layout
        self.rank, self.world_size = comm.rank, comm.world_size
        self._hosts, self._nonces = np.asarray(hosts, np.int64), np.asarray(nonces, np.int64)
        self.nonce = int(self._nonces[self.rank])  # names this rank's regions
        self._pin = pin
        # Decided at the first refill, alike on every rank (None: not yet; False: all_to_all).
        self._shared: SharedRecords | bool | None = None

    def start(self, n: int, k: int) -> Callable[[], None] | None:
        """Work to overlap with the stats exchange: none (the draw needs every rank's counts)."""
        return None

    def draw(self, stats: ExchangeStats, n: int, k: int, early: Any = None,
             released: Released | None = None) -> list[Drawn]:
        """``k`` batches of ``n`` windows for this rank, from every rank's ``stats`` (the
        same on every rank: masses, batch sizes, and rank 0's seed).

        Each of a requester's ``k`` batches takes Multinomial(n, mass/total) items from the
        shards, each item drawn from its shard's distribution: every batch is ``n`` i.i.d.
        draws from the global distribution (grouped by owner inside the batch).

        Raises:
            CollectiveTimeout: a peer rank did not join in time.
        """
        masses, batches, seed = stats.mass, stats.batch_size, int(stats.seed[0])
        total, low = float(masses.sum()), float(stats.min_leaf.min())
        me, n = self.rank, int(batches[self.rank])
        # [K requesters, k batches, K owners]: Multinomial(batch size, mass / total) per batch.
        counts = np.stack([np.random.default_rng([seed, r]).multinomial(int(batches[r]), masses / total,
                                                                          size=k).astype(np.int64)
                           for r in range(self.world_size)])
        own_rows, foreign_rows = _result_rows(counts[me], n, me)
        asked = counts.sum(axis=1).T.copy()  # asked[o, q]: items of owner o for requester q
        np.fill_diagonal(asked, 0)  # nothing is sent to oneself
        records = torch.empty((k * n, self._layout.record_bytes), dtype=torch.uint8, pin_memory=self._pin)
        out = records.numpy()
        share = float(masses[me]) / total
        shared = self._shared_records(asked.sum(axis=1))
        send = self._send_buffer(shared, int(asked[me].sum()))
        own_starts, own_prob = self._draw_records(asked[me], own_rows.size, send, share)
        write_own: Callable[[], None] | None = partial(self._write_records, out, own_rows, own_starts,
                                                       own_prob, share)
        if shared is not None:
            if self._read_shared(shared, send is not None, out, foreign_rows, asked, write_own, released):
                return self._split(records, n, total, low)
            write_own = None  # done while the ranks agreed to fall back
        if send is None:  # this rank's region failed: draw the others' items again
            send = np.empty((int(asked[me].sum()), self._layout.record_bytes), np.uint8)
            self._draw_records(asked[me], 0, send, share)
        rb = self._layout.record_bytes
        recv = self._comm.all_to_all(torch.from_numpy(send).reshape(-1), (asked[me] * rb).tolist(),
                                     (asked[:, me] * rb).tolist(),
                                     "ShardedReplayBuffer.sample(records)", while_waiting=write_own,
                                     released=released)
        if recv.numel():
            out[foreign_rows] = recv.cpu().numpy().reshape(-1, rb)
        return self._split(records, n, total, low)

    @property
    def uses_shared_memory(self) -> bool | None:
        """Whether refills go through shared memory (None before the first refill)."""
        return None if self._shared is None else self._shared is not False

    def _split(self, records: torch.Tensor, n: int, total: float, low: float) -> list[Drawn]:
        parts = torch_views(self._layout, records)
        return split_batches(data_parts(parts), parts["mask"], parts["key"], parts["probability"], n,
                             total, low, 1.0, self.local.current_beta(), records)

    def _shared_records(self, sent: np.ndarray) -> SharedRecords | None:
        """The same-host regions sized for this refill (rank ``r`` sends ``sent[r]``
        records), or None when the ranks exchange through all_to_all."""
        if self._shared is None:
            same_host = self.world_size > 1 and bool((self._hosts == self._hosts[0]).all())
            self._shared = SharedRecords(self._nonces, self.rank, self._layout.record_bytes) \
                if same_host else False
        if self._shared is False:
            return None
        assert isinstance(self._shared, SharedRecords)
        self._shared.plan(sent)
        return self._shared

    def _send_buffer(self, shared: SharedRecords | None, rows: int) -> np.ndarray | None:
        """Where this rank writes the records it sends: its region (None if that failed),
        or a plain array."""
        if shared is None:
            return np.empty((rows, self._layout.record_bytes), np.uint8)
        try:
            return shared.own_region(rows)
        except OSError as exc:
            _LOG.warning("rank %d: shared-memory region failed (%s); exchanging sampled records "
                         "through the process group from now on", self.rank, exc)
            return None

    def _read_shared(self, shared: SharedRecords, written: bool, out: np.ndarray,
                     foreign_rows: np.ndarray, asked: np.ndarray,
                     while_waiting: Callable[[], None] | None, released: Released | None) -> bool:
        """Agree that every region is written, then copy this rank's rows out of each
        owner's region. False (on every rank alike) when a rank's region failed: the
        exchange then goes through all_to_all, now and later."""
        ready = self._comm.all_gather(torch.tensor([float(written)], dtype=torch.float64),
                                      "ShardedReplayBuffer.sample(records written)",
                                      while_waiting=while_waiting, released=released).cpu().numpy()
        if not ready.all():
            shared.forget_names()
            self._shared = False
            return False
        shared.map_peers()
        if shared.fresh:  # alike on every rank: the sizes are planned from the same counts
            self._comm.all_gather(torch.zeros(1, dtype=torch.float64),
                                  "ShardedReplayBuffer.sample(regions mapped)", released=released)
            shared.forget_names()
        me, at = self.rank, 0
        for owner in range(self.world_size):
            count = int(asked[owner, me])
            if count:
                first = int(asked[owner, :me].sum())  # requesters before me in owner's region
                out[foreign_rows[at:at + count]] = shared.peer_rows(owner, first, count)
                at += count
        return True

    def _draw_records(self, asked: np.ndarray, own: int, send: np.ndarray | None,
                      share: float) -> tuple[np.ndarray, np.ndarray]:
        """Draw ``own`` windows of this shard for this rank and ``asked[r]`` for each other
        requester ``r``. The others' are written packed, in rank order, into ``send`` (when
        given); returns the starts and local probabilities of this rank's own.
        Probabilities written are global (times ``share``)."""
        others = int(asked.sum())
        if others + own == 0:
            return np.empty(0, np.int64), np.empty(0, np.float64)
        draw = self.local.draw(others + own, advance_schedule=False)
        if send is not None:
            self._write_records(send, np.arange(others), draw.starts[:others],
                                draw.probabilities[:others], share)
        return draw.starts[others:], draw.probabilities[others:]

    def _write_records(self, out: np.ndarray, rows: np.ndarray, starts: np.ndarray,
                       prob: np.ndarray, share: float) -> None:
        write_records(self.local, self._layout, out, rows, starts, prob * share, self.rank)


def _result_rows(mine: np.ndarray, n: int, me: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of this rank's result for its own items, and for the others' in the order they
    arrive (by owner, then batch). ``mine[j, o]`` items of owner ``o`` fill a run of rows
    inside batch ``j`` (rows ``j*n .. j*n + n``)."""
    first_row = np.arange(mine.shape[0])[:, None] * n + np.cumsum(mine, axis=1) - mine
    rows = _runs(first_row.T.reshape(-1), mine.T.reshape(-1))
    start = int(mine[:, :me].sum())
    own = np.arange(start, start + int(mine[:, me].sum()))
    return rows[own], np.delete(rows, own)


def _runs(firsts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(f, f + n) for f, n in zip(firsts, lengths)])``, vectorised."""
    ends = np.cumsum(lengths)
    return np.arange(int(ends[-1]) if ends.size else 0) + np.repeat(firsts - (ends - lengths), lengths)


def host_key(enabled: bool) -> int:
    """A number equal on ranks that share this host's ``/dev/shm`` (boot id, host name and
    the tmpfs's device and inode), and unique to this process when shared memory is
    disabled or unusable."""
    if not enabled or not os.access(SHM_DIR, os.W_OK):
        return nonce()
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    st = SHM_DIR.stat()
    digest = hashlib.blake2b(f"{boot}|{socket.gethostname()}|{st.st_dev}|{st.st_ino}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _KEY_BITS)


def nonce() -> int:
    """A fresh random 63-bit number (from the OS, not from any seeded generator, so two
    buffers built with the same seed never pick the same region names)."""
    return int.from_bytes(os.urandom(8), "little") >> (64 - _KEY_BITS)


class SharedRecords:
    """This rank's region of packed records, and read-only maps of the peers' regions
    (named by each rank's nonce, agreed by a collective)."""

    def __init__(self, nonces: np.ndarray, rank: int, record_bytes: int) -> None:
        self._nonces = [int(x) for x in nonces]
        self.rank = rank
        self.record_bytes = record_bytes
        world = len(self._nonces)
        self._rows = np.zeros(world, np.int64)  # capacity of each rank's region, in records
        self._gen = np.zeros(world, np.int64)  # 0: no region yet
        self.fresh = False
        self._own: np.ndarray | None = None
        self._peers: dict[int, tuple[int, np.ndarray]] = {}
        self._named: list[Path] = []
        weakref.finalize(self, _unlink_all, self._named)

    def _path(self, rank: int, gen: int) -> Path:
        return SHM_DIR / f"shardreplay-{self._nonces[rank]:016x}-r{rank}-g{gen}"

    def plan(self, rows: np.ndarray) -> None:
        """Size every rank's region for ``rows[r]`` records (every rank passes the same
        ``rows``, so all agree on every region's size and generation)."""
        grow = rows > self._rows
        self.fresh = bool(grow.any())  # a region is new: the ranks must agree it is mapped
        self._rows = np.where(grow, np.maximum(rows + rows // 4, 2 * self._rows), self._rows)
        self._gen += grow

    def own_region(self, rows: int) -> np.ndarray:
        """This rank's region as ``[rows, record_bytes]`` uint8, created when its planned
        generation is new.

        Raises:
            OSError: the region could not be created (e.g. ``/dev/shm`` is full).
        """
        gen, cap = int(self._gen[self.rank]), int(self._rows[self.rank])
        if gen == 0:
            return np.empty((0, self.record_bytes), np.uint8)
        if self._own is None or self._own.shape[0] != cap:
            self._own = None
            self._own = self._map(self._path(self.rank, gen), cap, create=True)
        return self._own[:rows]

    def peer_rows(self, rank: int, start: int, count: int) -> np.ndarray:
        """Rows ``start .. start + count`` of ``rank``'s region (read-only)."""
        return self._peers[rank][1][start:start + count]

    def map_peers(self) -> None:
        """Map every peer region of a new generation (all of them, needed now or not:
        their names are removed once every rank has mapped them)."""
        for rank, gen in enumerate(self._gen.tolist()):
            if rank != self.rank and gen and self._peers.get(rank, (0,))[0] != gen:
                self._peers[rank] = (gen, self._map(self._path(rank, gen), int(self._rows[rank]),
                                                    create=False))

    def forget_names(self) -> None:
        """Remove the names of this rank's regions (the peers have mapped them)."""
        _unlink_all(self._named)

    def _map(self, path: Path, rows: int, create: bool) -> np.ndarray:
        size = rows * self.record_bytes
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self._named.append(path)
        else:
            fd = os.open(path, os.O_RDONLY)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS on a later write
            view = mmap.mmap(fd, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if create else 0))
        finally:
            os.close(fd)
        return np.frombuffer(view, np.uint8).reshape(rows, self.record_bytes)


def _unlink_all(paths: list[Path]) -> None:
    while paths:
        paths.pop().unlink(missing_ok=True)
