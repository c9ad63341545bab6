"""Incremental parts write step types, discounts and priorities only where they changed
(format version 5: docs/semantics.md, "Incremental checkpoints"): a chain of small saves
writes bytes in proportion to the new steps and the updated priorities (version 4 wrote
9 bytes per stored step every time), and restores exactly what full saves of the same
content restore, onto 1 and 2 shards, with episodes sealed at one save and continued by
the next, and priorities updated between saves."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import checkpoint
from shardreplay.checkpoint.format import PartReader
from shardreplay.kernels.codes import PRIORITY_BLOCK
from tests.checkpoint.helpers import (
    as_shard,
    assert_arrays_equal,
    fill_random,
    make_buffer,
    restored_arrays,
    shard_arrays,
)

STREAMS, CAPACITY = 4, 512
MUTABLE = ("step_type", "discount", "priority", "prio.block", "prio.values", "prio.source",
           "seal.index", "seal.step_type", "seal.discount", "sealed.step_type", "sealed.discount")
# (new steps per stream, rounds of 16 priority updates) before each save after the first
ROUNDS = [(6, 1), (0, 1), (1, 2), (9, 0), (4, 1), (600, 1), (3, 1)]


def _mutable_bytes(directory: Path) -> tuple[int, int]:
    """The bytes a checkpoint's parts hold of step types, discounts and priorities, and
    the steps sealing changed (the first or last stored step of a partial episode)."""
    manifest = checkpoint.load_manifest(directory)
    total = sealed = 0
    for part in manifest.parts:
        with PartReader(directory / part.file, part) as reader:
            for name in set(MUTABLE) & set(reader.names()):
                dtype, shape = reader.entry(name)
                total += dtype.itemsize * int(np.prod(shape))
            sealed += reader.entry("seal.index")[1][0] if "seal.index" in reader.names() else 0
    return total, sealed


def _state(local: sr.ReplayBuffer) -> dict[str, np.ndarray]:
    return shard_arrays(local, trees=True)


def _restored(root: Path, cid: int, n: int) -> list[dict[str, np.ndarray]]:
    return restored_arrays(root, cid, n, STREAMS, CAPACITY, trees=True)


@pytest.mark.parametrize("num_shards", [1, 2])
def test_a_chain_of_small_saves_writes_what_changed_and_restores_exactly(tmp_path: Path,
                                                                         num_shards: int) -> None:
    inc, full = tmp_path / "inc", tmp_path / "full"
    locals_ = [make_buffer(STREAMS, CAPACITY, seed=k) for k in range(num_shards)]
    written = 700  # every ring wrapped: the oldest episode of a row lost its head
    for k, local in enumerate(locals_):
        fill_random(local, written, shard=k, seed=k)
        checkpoint.save(as_shard(local, k, num_shards), inc, 1, incremental=True, keep_last=None)
    for cid, (steps, updates) in enumerate(ROUNDS, start=2):
        for k, local in enumerate(locals_):
            fill_random(local, steps, shard=k, seed=10 * cid + k, update_rounds=updates, start=written,
                        ongoing=True)  # episodes open at the last save go on (or end) now
            checkpoint.save(as_shard(local, k, num_shards), inc, cid, incremental=True, keep_last=None)
            checkpoint.save(as_shard(local, k, num_shards), full, cid, keep_last=None)
        written += steps
        directory = checkpoint.checkpoint_dir(inc, cid)
        assert checkpoint.load_manifest(directory).version == 5
        # What changed: the new steps (5 bytes each), the sealed steps (the ends of partial
        # episodes: their index and values, sealed and as written, 18 bytes each), the
        # priority blocks written or updated, and a byte per block saying where it is.
        new = min(steps, CAPACITY) * STREAMS * num_shards
        n_blocks = STREAMS * CAPACITY // PRIORITY_BLOCK
        blocks = num_shards * min(16 * updates + 2 * STREAMS + new // PRIORITY_BLOCK, n_blocks)
        got, sealed = _mutable_bytes(directory)
        bound = 5 * new + 18 * sealed + (4 * PRIORITY_BLOCK + 8) * blocks + num_shards * n_blocks
        assert got <= bound, f"checkpoint {cid}: {got} bytes of step types, discounts, priorities > {bound}"
        if steps < 100:  # version 4 wrote 9 bytes per stored step (and the seals)
            assert bound < 9 * STREAMS * CAPACITY * num_shards / 2
        for n in (1, 2):  # as saved (n == num_shards) or re-planned
            assert_arrays_equal(_restored(inc, cid, n), _restored(full, cid, n), f"checkpoint {cid} onto {n}")
        # A faithful resume gives back every array and leaf as the buffer holds it.
        assert_arrays_equal(_restored(inc, cid, num_shards), [_state(local) for local in locals_], "as live")


def test_updates_and_writes_during_a_background_part_are_in_the_next_part(tmp_path: Path) -> None:
    """A background part holds the priorities as at its call; what changes while its child
    writes (updates, new steps) is written by the next part, which restores the buffer."""
    local = make_buffer(STREAMS, CAPACITY)
    fill_random(local, 700)
    checkpoint.save(local, tmp_path, 1, incremental=True)
    fill_random(local, 5, seed=1, start=700, ongoing=True)
    at_call = _state(local)
    pending = checkpoint.save_in_background(local, tmp_path, 2, incremental=True, keep_last=None)
    fill_random(local, 7, seed=2, update_rounds=4, start=705, ongoing=True)
    pending.wait(60)
    assert_arrays_equal(_restored(tmp_path, 2, 1), [at_call], "background part")
    checkpoint.save(local, tmp_path, 3, incremental=True, keep_last=None)
    assert checkpoint.load_manifest(checkpoint.checkpoint_dir(tmp_path, 3)).parts[0].refs  # chained
    assert_arrays_equal(_restored(tmp_path, 3, 1), [_state(local)], "the next part")
