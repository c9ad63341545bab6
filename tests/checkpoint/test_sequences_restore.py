"""Sequence windows kept by M -> N restores: the period grid (each step's offset in its
episode travels with it), the recurrent state stored at each start (bit for bit) and
the sampling distribution. In one process, as test_resharding.py does it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import checkpoint, testing
from shardreplay.checkpoint.loading import _load_one
from shardreplay.errors import ShardReplayError
from tests.checkpoint.helpers import as_shard
from tests.support.sequences import SPEC, timelines, write

WINDOW, PERIOD, STREAMS, CAP = 6, 3, 2, 24


def _buffer(streams: int, cap: int, seed: int, period: int = PERIOD) -> sr.ReplayBuffer:
    return sr.ReplayBuffer(SPEC, num_streams=streams, stream_capacity=cap, window=WINDOW, period=period,
                           sampler="prioritized", alpha=0.7, seed=seed)


def _windows(buf: sr.ReplayBuffer) -> dict[tuple[int, int], tuple[tuple[int, ...], bytes, float]]:
    """Every drawable window: start (stream id, time) -> (unmasked times, h bytes at the start, leaf)."""
    storage = testing.shard(buf).storage
    starts = np.flatnonzero(storage.valid)
    leaves = testing.leaf_masses(buf, starts)
    data, mask, _keys = storage.windows(starts)
    out = {}
    for i in range(starts.shape[0]):
        obs = data["obs"][i]
        out[(int(obs[0, 0]), int(obs[0, 1]))] = (tuple(obs[mask[i], 1].tolist()), data["h"][i, 0].tobytes(),
                                                 float(leaves[i]))
    return out


def _save(root: Path, m: int) -> dict:
    before: dict = {}
    for k in range(m):
        local = _buffer(STREAMS, CAP, seed=k)
        rng = np.random.default_rng(40 + k)
        # Episodes closed (a save would seal an open one, closing windows), rings wrapped
        # (episodes whose head was overwritten keep their grid).
        write(local, timelines(rng, STREAMS, 70, p_abandon=0.0, end_last=True), rng, id_base=10 * k)
        batch = local.sample(64)
        local.update_priorities(batch.keys, rng.uniform(0.1, 3.0, 64).astype(np.float32))
        before.update(_windows(local))
        checkpoint.save(as_shard(local, k, m), root, 1)
    return before


def _normalised(windows: dict) -> dict:
    total = sum(w[2] for w in windows.values())
    return {k: (w[0], w[1], w[2] / total) for k, w in windows.items()}


@pytest.mark.parametrize(("m", "n"), [(2, 3), (2, 1)])
def test_m_to_n_keeps_starts_state_and_distribution(tmp_path: Path, m: int, n: int) -> None:
    before = _save(tmp_path, m)
    after: dict = {}
    for k in range(n):
        local = _buffer(STREAMS, CAP * 3, seed=50 + k)
        _load_one(checkpoint.checkpoint_dir(tmp_path, 1), local, k, n)
        after.update(_windows(local))
    assert set(after) == set(before)
    norm_before, norm_after = _normalised(before), _normalised(after)
    for start, (times, state, p) in norm_before.items():
        assert norm_after[start][:2] == (times, state)  # same steps, state bit for bit
        assert norm_after[start][2] == pytest.approx(p, rel=1e-9)


def test_checkpoint_without_offsets_is_refused_by_a_sequence_buffer(tmp_path: Path) -> None:
    local = _buffer(STREAMS, CAP, seed=0, period=1)
    rng = np.random.default_rng(0)
    write(local, timelines(rng, STREAMS, 30), rng)
    checkpoint.save(as_shard(local, 0, 1), tmp_path, 1)
    target = _buffer(STREAMS, CAP, seed=0)
    with pytest.raises(ShardReplayError, match="episode_step"):
        _load_one(checkpoint.checkpoint_dir(tmp_path, 1), target, 0, 1)
    assert len(target) == 0  # a failed load leaves the buffer empty
