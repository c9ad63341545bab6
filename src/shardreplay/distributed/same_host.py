"""Collectives among ranks that share this host's ``/dev/shm``: how a sharded buffer's
exchange group talks when every rank is on one host (docs/internals.md, "The exchange's
collectives"), and the region names of the exact exchange's records.

Each rank maps a region of every rank (a file named by its nonce, removed once all have
mapped it): a generation counter, then two buffers of ``[section table | chunk]``. An
all_to_all moves ``CHUNK`` bytes per rank and round: a rank writes the round into the buffer
of its generation's parity, stores the generation in its counter (FUTEX_WAKE), and waits
until every peer's counter shows it (FUTEX_WAIT in slices; between slices it asks whether
the peers still run: each holds a POSIX lock on its region, which the kernel drops when
the process ends). A rank publishes generation g only after reading g - 1 of every peer,
so a buffer is never rewritten while a peer reads it. x86-64 only: its stores become
visible in program order and its loads are not reordered, so a peer that sees the counter
sees the chunk (elsewhere the group stays on gloo).
"""

from __future__ import annotations

import ctypes
import datetime
import fcntl
import hashlib
import mmap
import os
import platform
import socket
import time
import weakref
from pathlib import Path

import numpy as np

from shardreplay.errors import PeerLost

SHM_DIR = Path("/dev/shm")
CHUNK = 1 << 18  # bytes a rank sends per round
_KEY_BITS = 63  # host keys and nonces are non-negative int64s
_SLICE_S = 0.05  # a futex wait's slice: the peers' liveness is checked between slices
_SPIN = 20  # reads of a peer's counter before sleeping on it
_SYS_FUTEX = {"x86_64": 202}.get(platform.machine())
_WAIT, _WAKE, _ETIMEDOUT = 0, 1, 110
_LIBC = ctypes.CDLL(None, use_errno=True) if _SYS_FUTEX else None


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


def _futex(address: int, op: int, value: int, wait_s: float = 0.0) -> int:
    """One futex call on the shared word at ``address`` (ctypes lets the GIL go); its errno."""
    assert _LIBC is not None and _SYS_FUTEX is not None
    span = _Timespec(int(wait_s), int(wait_s % 1 * 1e9))
    rc = _LIBC.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_long(op),
                       ctypes.c_long(value), ctypes.byref(span), None, ctypes.c_long(0))
    return ctypes.get_errno() if rc < 0 else 0


def _reached(counter: int, gen: int) -> bool:
    return (counter - gen) & 0xFFFFFFFF < 0x80000000  # the 32-bit counter wraps


class SameHost:
    """This rank's end of the shared-memory collectives of ``world`` ranks: its region is
    made (and locked) by the constructor, before the ranks agree they share the host;
    :meth:`join` maps the peers'.

    Raises:
        OSError: no futex here (not x86-64 Linux), or the region could not be made.
    """

    def __init__(self, region_nonce: int, rank: int, world: int) -> None:
        if _SYS_FUTEX is None:
            raise OSError("shared-memory collectives need x86-64 Linux")
        self.rank, self.world, self.gen = rank, world, 0
        self._table = -(-8 * (world + 1) // 64) * 64  # where each receiver's section starts, the end
        self._size = 64 + 2 * (self._table + CHUNK)
        self._named = [region_path(region_nonce, rank, "c")]
        self._fds = [os.open(self._named[0], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)]
        self._close = weakref.finalize(self, _release, self._named, self._fds)
        try:
            fcntl.lockf(self._fds[0], fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while this process runs
            self._maps = [map_file(self._fds[0], self._size, create=True)]
        except OSError:
            self._close()
            raise

    def join(self, nonces: np.ndarray) -> None:
        """Map every rank's region (every rank made its own before the ranks agreed)."""
        for rank, region_nonce in enumerate(np.asarray(nonces).tolist()):
            if rank != self.rank:
                self._fds.insert(rank, os.open(region_path(region_nonce, rank, "c"), os.O_RDONLY))
                self._maps.insert(rank, map_file(self._fds[rank], self._size, create=False))
        self.words = [m[:4].view(np.uint32) for m in self._maps]
        self._wake = self.words[self.rank].ctypes.data
        at, n = [64, 64 + self._table + CHUNK], 8 * (self.world + 1)  # even and odd generations
        self.buffers = [[(m[a:a + n].view(np.int64), m[a + self._table:a + self._table + CHUNK]) for a in at]
                        for m in self._maps]

    def forget_name(self) -> None:
        """Remove this rank's region name (every peer has mapped it)."""
        unlink_all(self._named)

    def close(self) -> None:
        """Let the regions go (peers still waiting on this rank see it gone)."""
        self._close()
        self._maps, self.words, self.buffers = [], [], []

    def post(self, recv: np.ndarray, send: np.ndarray, send_sizes: list[int],
             recv_sizes: list[int]) -> Posted:
        """Start an all_to_all of bytes (uint8, contiguous; sections in rank order,
        ``send_sizes[r]`` to rank ``r``, ``recv_sizes[r]`` from it); :meth:`Posted.wait` ends it."""
        posted = Posted(self, recv, send, np.cumsum([0, *send_sizes]), recv_sizes)
        posted.publish(0)
        return posted

    def await_peers(self, deadline: float) -> bool:
        """Wait until every peer showed this rank's generation (False: ``deadline`` passed).

        Raises:
            PeerLost: a peer's process ended meanwhile.
        """
        for rank, word in enumerate(self.words):
            for _ in range(_SPIN):
                if _reached(int(word[0]), self.gen):
                    break
            else:
                while not _reached(seen := int(word[0]), self.gen):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    if _futex(word.ctypes.data, _WAIT, seen, min(left, _SLICE_S)) == _ETIMEDOUT:
                        self._check_alive(rank)
        return True

    def _check_alive(self, rank: int) -> None:
        try:
            fcntl.lockf(self._fds[rank], fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # its owner holds the lock: it runs
            return
        raise PeerLost(f"rank {rank} of this host's exchange group ended while this rank "
                       "waited for it (its process died?)")


class Posted:
    """An all_to_all of :class:`SameHost` (see :meth:`SameHost.post`)."""

    def __init__(self, host: SameHost, recv: np.ndarray, send: np.ndarray, table: np.ndarray,
                 sizes: list[int]) -> None:
        self.host, self.recv, self.send, self.table, self.sizes = host, recv, send, table, sizes

    def publish(self, round_: int) -> None:
        """Write this rank's table and chunk of ``round_``; show the new generation."""
        host = self.host
        host.gen += 1
        table, chunk = host.buffers[host.rank][host.gen & 1]
        table[:] = self.table
        part = self.send[round_ * CHUNK:(round_ + 1) * CHUNK]
        chunk[:part.size] = part
        host.words[host.rank][0] = host.gen & 0xFFFFFFFF
        _futex(host._wake, _WAKE, 1 << 30)

    def wait(self, timeout: datetime.timedelta) -> bool:
        """Run the rounds to the end (False: ``timeout`` passed first).

        Raises:
            PeerLost: a peer's process ended.
            RuntimeError: a peer sends this rank another number of bytes than it expects
                (the ranks call collectives in another order).
        """
        host, deadline, me = self.host, time.monotonic() + timeout.total_seconds(), self.host.rank
        rounds, round_, firsts, at = 1, 0, [0] * host.world, 0
        while True:
            if round_:
                self.publish(round_)
            if not host.await_peers(deadline):
                return False
            lo_round = round_ * CHUNK
            for rank, size in enumerate(self.sizes):
                table, chunk = host.buffers[rank][host.gen & 1]
                if not round_:
                    firsts[rank], end = int(table[me]), int(table[me + 1])
                    if end - firsts[rank] != size:
                        raise RuntimeError(f"rank {rank} sends {end - firsts[rank]} bytes, {size} expected")
                    rounds = max(rounds, -(-int(table[-1]) // CHUNK))
                first = firsts[rank]
                lo, hi = max(first, lo_round), min(first + size, lo_round + CHUNK)
                if lo < hi:
                    self.recv[at + lo - first:at + hi - first] = chunk[lo - lo_round:hi - lo_round]
                at += size
            round_, at = round_ + 1, 0
            if round_ >= rounds:
                return True


def region_path(region_nonce: int, rank: int, what: str) -> Path:
    """Where rank ``rank`` names a region (``what``: ``c`` collectives, ``g<n>`` records)."""
    return SHM_DIR / f"shardreplay-{region_nonce:016x}-r{rank}-{what}"


def map_file(fd: int, size: int, create: bool) -> np.ndarray:
    """``size`` bytes of the open file ``fd`` as uint8, writable when ``create`` (then the
    file gets its space now: ENOSPC here, not SIGBUS on a later write)."""
    if create:
        os.posix_fallocate(fd, 0, size)
    view = mmap.mmap(fd, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if create else 0))
    return np.frombuffer(view, np.uint8)


def _release(named: list[Path], fds: list[int]) -> None:
    unlink_all(named)
    while fds:
        os.close(fds.pop())


def unlink_all(paths: list[Path]) -> None:
    """Remove every name in ``paths`` (emptied)."""
    while paths:
        paths.pop().unlink(missing_ok=True)


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
