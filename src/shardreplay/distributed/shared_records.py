"""Same-host exchange of sampled records through shared memory.

When every rank of the group runs on one host, an owner writes the windows other ranks
drew from its shard into its own shared-memory region, one small collective says the
regions are written, and each requester copies its rows straight out of the owners'
regions. Over gloo's TCP loopback the same bytes would be copied into the kernel and out
again on both sides (NCCL does the equivalent inside a node).

Regions live in ``/dev/shm``. Every rank derives every region's size and generation from
the same counts, so regions grow without a word exchanged. A name is only needed until
the peers have mapped the region: in an exchange where a region is new, the ranks agree
that all have mapped it (one more small collective, rare: regions grow a few times per
run) and its creator removes the name, so only a run killed inside such an exchange
can leave a region behind.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import socket
import weakref
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm")
_KEY_BITS = 63  # host keys and nonces are non-negative int64s


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
    """This rank's region of packed records, and read-only maps of the peers' regions.

    Args:
        nonces: one number per rank naming its regions (agreed by a collective).
        rank: this rank.
        record_bytes: bytes per record.
    """

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
