"""A same-N restore is a faithful resume, and keys sampled before a save are stale after it.

Run A writes (rows wrap), samples and updates, saves, then runs 1,000 more steps of
sample + update (and a write to every stream every 100 steps, continuing the episodes
that were running at the save). Run B does the same up to the save, restores into fresh
buffers built with another seed, and runs the same 1,000 steps. Every batch must be
equal (data, mask, weights, probabilities, and keys except their generation bits: a
restore raises the key epoch so that keys of the earlier life are stale, which is also
checked here). On 1 rank (a ReplayBuffer) and on 3 real gloo ranks (ShardedReplayBuffer,
exact mode, whose shard-choice RNG must come back too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import checkpoint, testing
from shardreplay.checkpoint.loading import load_shard
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.errors import InvalidKeyError
from shardreplay.spec.keys import GEN_MASK
from tests.checkpoint.helpers import FIRST, LAST, MID, _step, as_shard, fill_random, make_buffer
from tests.support import run_ranks

STREAMS, CAPACITY = 3, 16
AFTER = 1_000
BATCH = 8


def _prios_for(batch: sr.Batch) -> np.ndarray:
    """New priorities that depend only on the batch's content (the same in both runs)."""
    ctr = batch.data["ctr"][:, 0].numpy()
    return ((ctr % 97) / 24.0 + 0.01).astype(np.float32)


def _write_round(buf: Any, t: int, shard: int) -> None:
    """One step of every stream, no writer priority (new starts get the max priority)."""
    rows = np.arange(STREAMS)
    kind = (t // 100) % 4
    types = np.full(STREAMS, (MID, MID, LAST, FIRST)[kind], np.uint8)
    disc = np.where(types == LAST, 0.0, 1.0).astype(np.float32)
    buf.add(_step(rows, 1000 + t // 100, shard, types, disc))


def _record(batch: sr.Batch) -> dict[str, np.ndarray]:
    out = {f"data.{k}": v.numpy().copy() for k, v in batch.data.items()}
    keys = batch.keys.numpy()
    out.update(mask=batch.mask.numpy().copy(), weights=batch.weights.numpy().copy(),
               probabilities=batch.probabilities.numpy().copy(), key_place=keys & ~np.int64(GEN_MASK),
               key_gen=keys & GEN_MASK)
    return out


def _steps_after(buf: Any, shard: int) -> list[dict[str, np.ndarray]]:
    out = []
    for t in range(AFTER):
        if t % 100 == 50:
            _write_round(buf, t, shard)
        batch = buf.sample(BATCH)
        out.append(_record(batch))
        buf.update_priorities(batch.keys, _prios_for(batch))
    return out


def _before_save(buf: Any, local: sr.ReplayBuffer, shard: int) -> np.ndarray:
    """Write (rows wrap: 37+ steps per row of 16), sample and update; return the keys of
    the last batch sampled before the save (for the staleness check)."""
    fill_random(local, 37 + 5 * shard, shard=shard, seed=100 + shard)
    rng = np.random.default_rng(7 + shard)
    keys = np.empty(0, np.int64)
    for _ in range(25):
        batch = buf.sample(BATCH)
        keys = batch.keys.numpy().copy()
        buf.update_priorities(batch.keys, rng.uniform(0.05, 6.0, BATCH).astype(np.float32))
    assert (testing.positions(local) > CAPACITY).all()  # every row has wrapped
    return keys


def _compare(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> int:
    """Assert every batch equal except the keys' generation bits; return how many keys'
    generations differ (all of them: the epoch moved)."""
    assert len(a) == len(b) == AFTER
    differing = 0
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.keys() == y.keys()
        for name in x:
            if name != "key_gen":
                np.testing.assert_array_equal(x[name], y[name], err_msg=f"batch {i}: {name}")
        differing += int((x["key_gen"] != y["key_gen"]).sum())
    return differing


def test_single_buffer_resume_is_exact_and_old_keys_are_stale(tmp_path: Path) -> None:
    a = make_buffer(STREAMS, CAPACITY, seed=5)
    old_keys = _before_save(a, a, 0)
    checkpoint.save(a, tmp_path, 1)
    state_a = {"max": a.info().max_priority, "pos": testing.positions(a), "rng": testing.rng_state(a)}
    run_a = _steps_after(a, 0)

    b = make_buffer(STREAMS, CAPACITY, seed=999)  # another seed: the RNG must come from the checkpoint
    report = checkpoint.load(tmp_path, b)
    assert report.exact and report.skipped == []
    assert b.info().max_priority == state_a["max"]
    np.testing.assert_array_equal(testing.positions(b), state_a["pos"])  # absolute positions, not 0
    assert testing.rng_state(b) == state_a["rng"]
    run_b = _steps_after(b, 0)
    assert _compare(run_a, run_b) == AFTER * BATCH  # equal but for the keys' generation bits

    c = make_buffer(STREAMS, CAPACITY, seed=999)
    checkpoint.load(tmp_path, c)
    assert c.update_priorities(old_keys, np.full(BATCH, 5.0, np.float32)) == 0
    assert c.info().stale_updates == BATCH


def _rank_runs(rank: int, world: int, root: str) -> dict[str, Any]:
    a_local = make_buffer(STREAMS, CAPACITY, seed=rank)
    a = ShardedReplayBuffer(a_local, timeout_s=60, seed=11)
    old_keys = _before_save(a, a_local, rank)
    checkpoint.save(a, root, 1)
    max_a = a_local.info().max_priority
    run_a = _steps_after(a, rank)

    b_local = make_buffer(STREAMS, CAPACITY, seed=100 + rank)
    b = ShardedReplayBuffer(b_local, timeout_s=60, seed=77)  # another seed for both RNGs
    report = checkpoint.load(root, b)
    max_b = b_local.info().max_priority
    run_b = _steps_after(b, rank)

    c_local = make_buffer(STREAMS, CAPACITY, seed=200 + rank)
    c = ShardedReplayBuffer(c_local, timeout_s=60, seed=78)
    checkpoint.load(root, c)
    c.update_priorities(old_keys, np.full(BATCH, 5.0, np.float32))
    return {"run_a": run_a, "run_b": run_b, "max": (max_a, max_b), "exact": report.exact,
            "stale": c_local.info().stale_updates, "applied": c.info().updates_applied}


@pytest.mark.distributed
@pytest.mark.slow
def test_three_gloo_ranks_resume_exactly_and_old_keys_are_stale(tmp_path: Path) -> None:
    results = run_ranks(_rank_runs, 3, str(tmp_path), timeout_s=300)
    for rank, r in enumerate(results):
        assert r["exact"], f"rank {rank}"
        assert r["max"][0] == r["max"][1], f"rank {rank}: max priority {r['max']}"
        assert _compare(r["run_a"], r["run_b"]) == AFTER * BATCH, f"rank {rank}"
    assert sum(r["applied"] for r in results) == 0
    assert sum(r["stale"] for r in results) == 3 * BATCH


@pytest.mark.parametrize(("m", "n"), [(2, 2), (2, 1), (1, 3)])
def test_keys_sampled_before_a_save_are_stale_after_any_restore(tmp_path: Path, m: int, n: int) -> None:
    """The issue's case: rows that never wrapped, keys of generation 1 before and after.

    Restored shard ``s`` takes saved shard ``s``'s key tag, so its keys are recognised
    (and found stale); keys of another saved shard are another buffer's and refused.
    """
    keys = []
    for k in range(m):
        local = make_buffer(STREAMS, 40, seed=k)
        fill_random(local, 10, shard=k, seed=30 + k, update_rounds=0)
        keys.append(local.sample(BATCH).keys.numpy())  # shard 0 keys (a plain buffer's)
        checkpoint.save(as_shard(local, k, m), tmp_path, 1)
    applied = 0
    for shard in range(n):
        restored = make_buffer(STREAMS, 40, seed=50)
        report = load_shard(checkpoint.checkpoint_dir(tmp_path, 1), restored, shard, n)
        assert report.exact == (m == n)
        for k, saved in enumerate(keys):
            if k == shard:
                applied += restored.update_priorities(saved, np.full(BATCH, 9.0, np.float32))
                assert restored.info().stale_updates == BATCH
            else:
                with pytest.raises(InvalidKeyError):
                    restored.update_priorities(saved, np.full(BATCH, 9.0, np.float32))
    assert applied == 0
