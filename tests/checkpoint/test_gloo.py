"""Sharded save and M -> N load through real gloo ranks (ShardedReplayBuffer + load)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import checkpoint, testing
from shardreplay.buffer.shard import STEP_ARRAYS
from shardreplay.checkpoint import format as ckfmt
from shardreplay.checkpoint.loading import load_shard
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.errors import CheckpointFormatError
from tests.checkpoint.helpers import (
    as_shard,
    assert_same_distribution,
    fill_random,
    make_buffer,
    step_multiset,
    stored_steps,
    union_distribution,
    window_table,
)
from tests.support import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # ~15 s per launch of ranks

STREAMS, CAPACITY = 3, 40


def _storage_arrays(local: sr.ReplayBuffer) -> dict[str, np.ndarray]:
    out = {name: testing.stored(local, name) for name in STEP_ARRAYS}
    out.update({f"field.{k}": testing.stored(local, k) for k in testing.shard(local).fields})
    out["pos"] = testing.positions(local)
    return out


def _save_rank(rank: int, world: int, root: str, cid: int) -> dict:
    local = make_buffer(STREAMS, CAPACITY, seed=rank)
    fill_random(local, 30 + 25 * rank, shard=rank, seed=100 + rank)
    buf = ShardedReplayBuffer(local, timeout_s=30)
    buf.sample(8)
    table, steps = window_table(local), step_multiset(local)
    checkpoint.save(buf, root, cid, files={f"step-{rank}.json": b"%d" % (1000 + cid)})
    return {"table": table, "steps": steps}


def _load_rank(rank: int, world: int, root: str, capacity: int) -> dict:
    local = make_buffer(STREAMS, capacity, seed=10 + rank)
    fill_random(local, 5, seed=rank)  # old content is replaced
    buf = ShardedReplayBuffer(local, timeout_s=30)
    report = checkpoint.load(root, buf, files=("step-0.json",))
    s = stored_steps(local)
    out = {"table": window_table(local), "steps": step_multiset(local), "arrays": _storage_arrays(local),
           "report": (report.checkpoint_id, report.files["step-0.json"], report.saved_shards, report.steps),
           "env_is_row": bool((s["env"] == s["row"]).all())}
    batch = buf.sample(16)  # the restored group samples and updates priorities
    out["applied"] = buf.update_priorities(batch.keys, np.full(16, 0.5, np.float32))
    return out


@pytest.mark.parametrize(("m", "n"), [(3, 2), (2, 4)])
def test_gloo_save_on_m_ranks_load_on_n_ranks(tmp_path: Path, m: int, n: int) -> None:
    saved = run_ranks(_save_rank, m, str(tmp_path), 7)
    manifest = checkpoint.load_manifest(checkpoint.checkpoint_dir(tmp_path, 7))
    assert manifest.num_shards == m and {f"step-{r}.json" for r in range(m)} <= set(manifest.files)
    capacity = CAPACITY if m <= n else CAPACITY * (m + 1)
    loaded = run_ranks(_load_rank, n, str(tmp_path), capacity)

    assert_same_distribution(union_distribution([r["table"] for r in saved]),
                             union_distribution([r["table"] for r in loaded]))
    before = {k: v for r in saved for k, v in r["steps"].items()}
    after = {k: v for r in loaded for k, v in r["steps"].items()}
    assert after == before and sum(len(r["steps"]) for r in loaded) == len(before)
    assert sum(r["applied"] for r in loaded) == n * 16
    for rank, r in enumerate(loaded):
        assert r["report"][:3] == (7, b"1007", m)
        assert r["env_is_row"]
        # Every machine computes the same layout: the rank equals an in-process restore.
        local = make_buffer(STREAMS, capacity)
        load_shard(checkpoint.checkpoint_dir(tmp_path, 7), local, rank, n)
        for name, arr in _storage_arrays(local).items():
            np.testing.assert_array_equal(arr, r["arrays"][name], err_msg=name)


def _load_with_rank1_failing(rank: int, world: int, root: str, bad: str) -> dict:
    """Rank 1 finds a corrupt block in checkpoint ``bad`` (as if only its episodes
    lay there); every rank must agree to fall back together."""
    if rank == 1:
        real = ckfmt.PartReader._load_block

        def failing(self, block):
            if bad in str(self.path):
                raise CheckpointFormatError(f"{self.path}: checksum mismatch in block {block}")
            return real(self, block)

        ckfmt.PartReader._load_block = failing
    local = make_buffer(STREAMS, CAPACITY * 4, seed=rank)
    buf = ShardedReplayBuffer(local, timeout_s=30)
    report = checkpoint.load(root, buf, fallback=True)
    plain_error = ""
    try:
        checkpoint.load(root, buf)  # without fallback every rank raises
    except CheckpointFormatError as exc:
        plain_error = str(exc)
    return {"cid": report.checkpoint_id, "skipped": report.skipped, "steps": report.steps,
            "error": plain_error}


def test_gloo_fallback_is_agreed_by_all_ranks(tmp_path: Path) -> None:
    for cid in (5, 6):
        for k in range(2):
            local = make_buffer(STREAMS, CAPACITY, seed=k)
            fill_random(local, 40, shard=k, seed=cid + k)
            checkpoint.save(as_shard(local, k, 2), tmp_path, cid)
    results = run_ranks(_load_with_rank1_failing, 2, str(tmp_path), "ckpt-0000000006")
    assert [r["cid"] for r in results] == [5, 5]
    assert all(len(r["skipped"]) == 1 and r["skipped"][0].startswith("6:") for r in results)
    assert "rank(s) [1]" in results[0]["skipped"][0]
    assert "checksum mismatch" in results[1]["skipped"][0]
    assert sum(r["steps"] for r in results) > 0
    assert "rank(s) [1]" in results[0]["error"] and "checksum mismatch" in results[1]["error"]


def _save_uneven_rank(rank: int, world: int, root: str, rows: tuple[int, ...]) -> dict:
    local = make_buffer(rows[rank], CAPACITY, seed=rank)
    fill_random(local, 30 + 25 * rank, shard=rank, seed=200 + rank)
    buf = ShardedReplayBuffer(local, timeout_s=30)
    table, steps = window_table(local), step_multiset(local)
    checkpoint.save(buf, root, 3)
    return {"table": table, "steps": steps}


def _load_uneven_rank(rank: int, world: int, root: str, rows: tuple[int, ...],
                      caps: tuple[int, ...]) -> dict:
    local = make_buffer(rows[rank], caps[rank], seed=20 + rank)
    buf = ShardedReplayBuffer(local, timeout_s=30)
    report = checkpoint.load(root, buf)
    s = stored_steps(local)
    return {"table": window_table(local), "steps": step_multiset(local), "exact": report.exact,
            "counts": (report.steps, report.dropped_steps, report.saved_steps),
            "env_is_row": bool((s["env"] == s["row"]).all())}


@pytest.mark.parametrize(("saved_rows", "new_rows", "new_caps"), [
    ((8, 4), (6, 5, 5), (CAPACITY, CAPACITY, CAPACITY)),  # train's 2x4 -> 3 (4 envs per actor)
    ((3, 5, 2), (3, 5, 2), (CAPACITY, CAPACITY, CAPACITY)),  # same uneven layout: put back as saved
    ((2, 2), (5, 1, 3), (CAPACITY, 3 * CAPACITY, CAPACITY // 2 + 9)),  # rows and capacities differ
])
def test_gloo_restore_onto_ranks_of_unequal_rows_places_every_step_once(
        tmp_path: Path, saved_rows: tuple[int, ...], new_rows: tuple[int, ...],
        new_caps: tuple[int, ...]) -> None:
    """Ranks holding different numbers of rows (and row capacities) plan with the layout
    of every rank: each saved step is restored exactly once, nothing is dropped while it
    fits, and the sampled distribution is the saved one."""
    saved = run_ranks(_save_uneven_rank, len(saved_rows), str(tmp_path), saved_rows)
    loaded = run_ranks(_load_uneven_rank, len(new_rows), str(tmp_path), new_rows, new_caps)
    before = {k: v for r in saved for k, v in r["steps"].items()}
    after = {k: v for r in loaded for k, v in r["steps"].items()}
    assert sum(len(r["steps"]) for r in loaded) == len(after)  # no step on two ranks
    restored, dropped = (sum(r["counts"][i] for r in loaded) for i in (0, 1))
    total = loaded[0]["counts"][2]
    assert total == sum(len(r["steps"]) for r in saved) == len(before)
    assert restored + dropped == total
    if saved_rows == new_rows or min(new_caps) >= CAPACITY:
        assert dropped == 0 and after == before
        assert_same_distribution(union_distribution([r["table"] for r in saved]),
                                 union_distribution([r["table"] for r in loaded]))
    else:
        assert set(after) <= set(before) and len(after) == restored
    assert all(r["exact"] == (saved_rows == new_rows) for r in loaded)
    assert all(r["env_is_row"] for r in loaded)
