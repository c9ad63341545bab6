"""Exact sampling between ranks of one host goes through shared-memory regions.

Real gloo ranks. Two sharded buffers over identical shards with identical seeds draw the
same items; one exchanges records through shared memory, the other (``shared_memory=
False``) through all_to_all, and every batch must be equal byte for byte, over batch
sizes that make the regions grow. Also: a rank whose region cannot be created makes all
ranks fall back together; a rank that opts out keeps every rank on all_to_all; no region
keeps a name in /dev/shm once the peers have mapped it or the buffer is gone.
"""

from __future__ import annotations

import errno
import gc
import os
from types import SimpleNamespace

import numpy as np
import pytest

import shardreplay as sr
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.distributed.exact_exchange import SharedRecords
from shardreplay.distributed.same_host import SHM_DIR
from shardreplay.distributed.sharded_buffer import internals_of
from shardreplay.spec.keys import TAG_MASK, TAG_SHIFT, key_shard
from tests.support import run_ranks

pytestmark = pytest.mark.distributed

SPEC = sr.Spec({"obs": sr.Field((6,), np.float32), "action": sr.Field((), np.int64),
                "reward": sr.Field((), np.float32)})
SIZES = [4, 64, 16, 700, 700, 32]  # 700 after 64: every region grows at least once
PREFETCH = 3


def _shard(rank: int) -> sr.ReplayBuffer:
    local = sr.ReplayBuffer(SPEC, num_streams=3, stream_capacity=200, window=2,
                            sampler="prioritized", seed=50 + rank)
    rng = np.random.default_rng(rank)
    for t in range(150 + 40 * rank):  # uneven shards
        types = np.where(rng.random(3) < 0.1, 2, 1) if t else np.zeros(3, np.int64)
        local.add({"obs": rng.standard_normal((3, 6), dtype=np.float32),
                   "action": rng.integers(0, 5, 3), "reward": rng.standard_normal(3, dtype=np.float32),
                   "step_type": types}, priorities=rng.uniform(0.1, 2.0, 3))
    return local


def _untagged(keys: np.ndarray) -> np.ndarray:
    """Keys without their key tag: the two buffers compared hold equal shards of their own."""
    return keys & ~np.int64(TAG_MASK << TAG_SHIFT)


def _batches(buf: ShardedReplayBuffer, log: list[str]) -> list[dict[str, np.ndarray]]:
    comm = internals_of(buf).exchange_group  # on one host: the shared-memory collectives
    for name in ("all_gather", "all_to_all"):
        method = getattr(comm, name)
        setattr(comm, name, lambda *a, _m=method, **kw: (log.append(a[3] if len(a) > 3 else a[1]),
                                                        _m(*a, **kw))[1])
    out = []
    for size in SIZES:
        for _ in range(PREFETCH):
            b = buf.sample(size)
            out.append({**{f"data.{k}": v.numpy().copy() for k, v in b.data.items()},
                        "mask": b.mask.numpy().copy(), "keys": _untagged(b.keys.numpy()),
                        "weights": b.weights.numpy().copy(), "prob": b.probabilities.numpy().copy()})
    return out


def _own_names(buf: ShardedReplayBuffer) -> list[str]:
    host = internals_of(buf).exchange_group.same_host
    return [] if host is None else sorted(p.name for p in SHM_DIR.glob(f"shardreplay-{host.nonce:016x}-*"))


def _same_draws(rank: int, world: int) -> dict:
    shared_log: list[str] = []
    plain_log: list[str] = []
    shared = ShardedReplayBuffer(_shard(rank), timeout_s=120, seed=9 + rank, prefetch=PREFETCH)
    plain = ShardedReplayBuffer(_shard(rank), timeout_s=120, seed=9 + rank, prefetch=PREFETCH,
                                shared_memory=False)
    exchange = internals_of(shared).strategy
    out = {"shared": _batches(shared, shared_log), "plain": _batches(plain, plain_log),
           "shared_log": shared_log, "plain_log": plain_log,
           "uses_regions": exchange.uses_shared_memory,
           "rows": int(exchange._shared._rows[rank]) if exchange._shared is not None else 0}
    out["names_while_alive"] = _own_names(shared)
    host = internals_of(shared).exchange_group.same_host
    assert host is not None
    nonce = host.nonce
    del shared, exchange
    gc.collect()
    out["names_after"] = sorted(p.name for p in SHM_DIR.glob(f"shardreplay-{nonce:016x}-*"))
    return out


@pytest.mark.skipif(not os.access(SHM_DIR, os.W_OK), reason="needs a writable /dev/shm")
@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_batches_equal_all_to_all_batches_byte_for_byte(world: int) -> None:
    results = run_ranks(_same_draws, world)
    for rank, r in enumerate(results):
        assert r["uses_regions"]
        assert r["rows"] > 4 * PREFETCH * world  # the areas grew past the first exchange's
        assert len(r["shared"]) == len(r["plain"]) == len(SIZES) * PREFETCH
        for got, want in zip(r["shared"], r["plain"], strict=True):
            assert got.keys() == want.keys()
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"rank {rank} {name}")
        owners = np.concatenate([key_shard(b["keys"]) for b in r["shared"]])
        assert set(np.unique(owners)) == set(range(world))  # items of every shard arrived
        assert "ShardedReplayBuffer.sample(records written)" in r["shared_log"]
        assert "ShardedReplayBuffer.sample(records)" not in r["shared_log"]
        assert "ShardedReplayBuffer.sample(records)" in r["plain_log"]
        assert r["names_while_alive"] == []  # removed once every rank mapped them
        assert r["names_after"] == []
        assert "ShardedReplayBuffer.sample(regions mapped)" not in r["shared_log"]  # no names to remove


def _one_region_fails(rank: int, world: int) -> dict:
    if rank == 1:
        def full(self: SharedRecords, rows: int) -> np.ndarray:
            raise OSError(errno.ENOSPC, "No space left on device (test)")
        SharedRecords.own_region = full  # type: ignore[method-assign]
    shared_log: list[str] = []
    plain_log: list[str] = []
    shared = ShardedReplayBuffer(_shard(rank), timeout_s=120, seed=9 + rank, prefetch=PREFETCH)
    plain = ShardedReplayBuffer(_shard(rank), timeout_s=120, seed=9 + rank, prefetch=PREFETCH,
                                shared_memory=False)
    return {"shared": _batches(shared, shared_log), "plain": _batches(plain, plain_log),
            "shared_log": shared_log, "fell_back": internals_of(shared).strategy.uses_shared_memory is False,
            "names_after": _own_names(shared)}


@pytest.mark.skipif(not os.access(SHM_DIR, os.W_OK), reason="needs a writable /dev/shm")
def test_a_rank_without_a_region_makes_every_rank_fall_back_together() -> None:
    results = run_ranks(_one_region_fails, 2)
    for rank, r in enumerate(results):
        assert r["fell_back"], rank
        # One "records written" round found the failure; everything after is all_to_all.
        assert r["shared_log"].count("ShardedReplayBuffer.sample(records written)") == 1
        assert r["shared_log"].count("ShardedReplayBuffer.sample(records)") == len(SIZES)
        assert r["names_after"] == []
        # Draws differ from the plain buffer's only in which items the failed round drew
        # for others; every batch still holds whole, well-formed windows of all shards.
        for b in r["shared"]:
            assert b["mask"][:, 0].all()
            assert np.isfinite(b["data.obs"]).all()
        # After the fall-back, the shared buffer's batches match a plain buffer's layout.
        assert [b["keys"].shape for b in r["shared"]] == [b["keys"].shape for b in r["plain"]]


def _one_rank_opts_out(rank: int, world: int) -> dict:
    log: list[str] = []
    buf = ShardedReplayBuffer(_shard(rank), timeout_s=120, seed=9 + rank,
                              shared_memory=rank != 0)
    batches = _batches(buf, log)
    return {"log": log, "off": internals_of(buf).strategy.uses_shared_memory is False,
            "n": sum(len(b["keys"]) for b in batches)}


def test_one_rank_opting_out_keeps_every_rank_on_all_to_all() -> None:
    results = run_ranks(_one_rank_opts_out, 2)
    for r in results:
        assert r["off"]
        assert "ShardedReplayBuffer.sample(records written)" not in r["log"]
        assert r["log"].count("ShardedReplayBuffer.sample(records)") == len(SIZES) * PREFETCH
        assert r["n"] == sum(SIZES) * PREFETCH


def test_every_rank_sizes_every_area_alike() -> None:
    a = SharedRecords(SimpleNamespace(rank=0, world=2), 16)  # type: ignore[arg-type]
    b = SharedRecords(SimpleNamespace(rank=1, world=2), 16)  # type: ignore[arg-type]
    for regions in (a, b):
        regions.plan(np.array([10, 0]))
        regions.plan(np.array([30, 5]))
    assert a._rows.tolist() == b._rows.tolist() == [37, 6]
