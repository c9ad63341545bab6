"""Collectives among ranks that share this host's ``/dev/shm``: a sharded buffer's exchange
group when every rank is on one host (docs/multi-machine.md, "On one host").

Each rank maps every rank's region (a file named by its nonce, removed once all have mapped
it): a generation counter, two buffers of ``[section table | chunk]``, then the exact
exchange's records. An all_to_all moves up to ``CHUNK`` bytes per rank and round: a rank
writes the buffer of its next generation's parity, stores that generation (FUTEX_WAKE) and
waits until every peer's counter shows it (FUTEX_WAIT in slices, between which it asks
whether the peers run: each holds a flock on its region, which the kernel drops when the
process ends). A rank publishes generation g only after reading every peer's g - 1, so no
buffer is rewritten while read. x86-64 only (stores and loads keep their order: a peer
that sees the counter sees the chunk); elsewhere the group stays on gloo.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import itertools
import mmap
import os
import platform
import socket
import time
import weakref
from pathlib import Path

import numpy as np

from shardreplay.errors import PeerLost
from shardreplay.kernels import exchange as kernels

SHM_DIR = Path("/dev/shm")
CHUNK = 1 << 18  # bytes a rank sends per round
_KEY_BITS = 63  # host keys and nonces are non-negative int64s
_SLICE_NS = 50_000_000  # a futex wait's slice: the peers' liveness is checked between slices


class SameHost:
    """This rank's end of the shared-memory collectives of ``world`` ranks: its region is
    made (and locked) by the constructor, before the ranks agree they share the host;
    :meth:`join` maps the peers'.

    Raises:
        OSError: no futex here (not x86-64 Linux), or the region could not be made.
    """

    def __init__(self, region_nonce: int, rank: int, world: int) -> None:
        if platform.machine() != "x86_64":
            raise OSError("shared-memory collectives need x86-64 Linux")
        self.rank, self.world, self.gen, self.nonce = rank, world, 0, region_nonce
        self._table = -(-8 * (world + 1) // 64) * 64  # where each receiver's section starts, the end
        self._size = 64 + 2 * (self._table + CHUNK)
        self._base = -(-self._size // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY  # records
        self._named = [_path(region_nonce, rank)]
        self._fds = [os.open(self._named[0], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)]
        self._close = weakref.finalize(self, _release, self._named, self._fds)
        try:
            fcntl.flock(self._fds[0], fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while this file is open
            self._maps = [map_file(self._fds[0], self._size, create=True)]
        except OSError:
            self._close()
            raise

    def join(self, nonces: np.ndarray) -> None:
        """Map every rank's region (every rank made its own before the ranks agreed)."""
        for rank, region_nonce in enumerate(np.asarray(nonces).tolist()):
            if rank != self.rank:
                self._fds.insert(rank, os.open(_path(region_nonce, rank), os.O_RDONLY))
                self._maps.insert(rank, map_file(self._fds[rank], self._size, create=False))
        self.words = [m[:4].view(np.uint32) for m in self._maps]
        self._records = [np.empty(0, np.uint8)] * self.world
        self._addresses = np.array([word.ctypes.data for word in self.words], np.int64)
        at, n = [64, 64 + self._table + CHUNK], 8 * (self.world + 1)  # even and odd generations
        self.buffers = [[(m[a:a + n].view(np.int64), m[a + self._table:a + self._table + CHUNK]) for a in at]
                        for m in self._maps]

    def records(self, rank: int, nbytes: int) -> np.ndarray:
        """``rank``'s records area of ``nbytes`` (behind its collectives' buffers): this rank's
        is given the space first (``OSError``: /dev/shm is full), a peer's mapped again once
        it grew (every rank sizes every area alike, and reads a peer's after it was written)."""
        if self._records[rank].size < nbytes:
            self._records[rank] = map_file(self._fds[rank], nbytes, rank == self.rank, self._base)
        return self._records[rank][:nbytes]

    def forget_name(self) -> None:
        """Remove this rank's region name (every peer has mapped it)."""
        _release(self._named, [])

    def leave(self) -> None:
        """Let this rank's region lock go: its peers see it ended (``PeerLost``)."""
        fcntl.flock(self._fds[self.rank], fcntl.LOCK_UN)

    def close(self) -> None:
        """Let the regions go (peers still waiting on this rank see it gone)."""
        self._close()
        self._maps, self.words, self.buffers = [], [], []

    def post(self, recv: np.ndarray, send: np.ndarray, send_sizes: list[int],
             recv_sizes: list[int]) -> SameHost:
        """Start an all_to_all of bytes (uint8, contiguous; sections in rank order,
        ``send_sizes[r]`` to rank ``r``, ``recv_sizes[r]`` from it); :meth:`wait` ends it."""
        self._op = (recv, send, list(itertools.accumulate(send_sizes, initial=0)), recv_sizes)
        self._publish(0)
        return self

    def wait(self, timeout: datetime.timedelta) -> bool:
        """Run the rounds of the all_to_all posted to the end (False: ``timeout`` passed first).

        Raises:
            PeerLost: a peer's process ended.
            RuntimeError: a peer sends this rank another number of bytes than it expects
                (the ranks call collectives in another order).
        """
        (recv, _, _, sizes), deadline = self._op, time.monotonic() + timeout.total_seconds()
        rounds, round_ = 1, 0
        while round_ < rounds:
            if round_:
                self._publish(round_)
            if not self._await(deadline):
                return False
            low, at = round_ * CHUNK, 0
            for rank, size in enumerate(sizes):
                table, chunk = self.buffers[rank][self.gen & 1]  # the same table every round
                first, end = int(table[self.rank]), int(table[self.rank + 1])
                if not round_:
                    if end - first != size:
                        raise RuntimeError(f"rank {rank} sends {end - first} bytes, {size} expected")
                    rounds = max(rounds, -(-int(table[-1]) // CHUNK))
                lo, hi = max(first, low), min(first + size, low + CHUNK)
                if lo < hi:
                    recv[at + lo - first:at + hi - first] = chunk[lo - low:hi - low]
                at += size
            round_ += 1
        return True

    def _publish(self, round_: int) -> None:
        """Write this rank's table and chunk of ``round_``; show the new generation."""
        _, send, starts, _ = self._op
        self.gen += 1
        table, chunk = self.buffers[self.rank][self.gen & 1]
        table[:] = starts
        part = send[round_ * CHUNK:(round_ + 1) * CHUNK]
        chunk[:part.size] = part
        self.words[self.rank][0] = self.gen & 0xFFFFFFFF
        kernels.wake(self._addresses[self.rank])

    def _await(self, deadline: float) -> bool:
        """Wait without the GIL until every peer showed this rank's generation (False: past ``deadline``)."""
        while (rank := kernels.wait_for(self._addresses, self.gen & 0xFFFFFFFF, _SLICE_NS)) >= 0:
            if time.monotonic() >= deadline:
                return False
            self._check_alive(rank)
        return True

    def _check_alive(self, rank: int) -> None:
        try:
            fcntl.flock(self._fds[rank], fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # its owner holds the lock: it runs
            return
        raise PeerLost(f"rank {rank} of this host's exchange group ended while this rank "
                       "waited for it (its process died, or it lost a peer on another host?)")


def _path(region_nonce: int, rank: int) -> Path:
    return SHM_DIR / f"shardreplay-{region_nonce:016x}-r{rank}"


def map_file(fd: int, size: int, create: bool, offset: int = 0) -> np.ndarray:
    """``size`` bytes of the open file ``fd`` from ``offset`` as uint8, writable when
    ``create`` (then the file gets its space now: ENOSPC here, not SIGBUS on a later write)."""
    if create:
        os.posix_fallocate(fd, offset, size)
    view = mmap.mmap(fd, size, offset=offset, prot=mmap.PROT_READ | (mmap.PROT_WRITE if create else 0))
    return np.frombuffer(view, np.uint8)


def _release(named: list[Path], fds: list[int]) -> None:
    while named:
        named.pop().unlink(missing_ok=True)
    while fds:
        os.close(fds.pop())


def host_key(enabled: bool) -> int:
    """A number equal on ranks that share this host's ``/dev/shm`` (boot id, host name and
    the tmpfs's device and inode), and unique to this process when shared memory is
    disabled or unusable. ``SHARDREPLAY_HOST`` in the environment, when set, stands for the
    host name: tests group ranks of one machine into emulated hosts with it."""
    if not enabled or not os.access(SHM_DIR, os.W_OK):
        return nonce()
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    st, name = SHM_DIR.stat(), os.environ.get("SHARDREPLAY_HOST") or socket.gethostname()
    digest = hashlib.blake2b(f"{boot}|{name}|{st.st_dev}|{st.st_ino}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _KEY_BITS)


def nonce() -> int:
    """A fresh random 63-bit number (from the OS, not from any seeded generator, so two
    buffers built with the same seed never pick the same region names)."""
    return int.from_bytes(os.urandom(8), "little") >> (64 - _KEY_BITS)
