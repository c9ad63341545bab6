"""Sequence windows kept by M -> N restores: the period grid (each step's offset in its
episode travels with it), the recurrent state stored at each start (bit for bit, as a
plain field and as an ``at_starts`` field whose parts hold start rows only) and the
sampling distribution. In one process, as test_resharding.py does it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import checkpoint, testing
from shardreplay.checkpoint.loading import load_shard
from shardreplay.checkpoint.summary import verify
from shardreplay.errors import CheckpointError, ShardReplayError
from tests.checkpoint.helpers import as_shard
from tests.support.sequences import SPEC, START_SPEC, state_of, timelines, write

WINDOW, PERIOD, STREAMS, CAP = 6, 3, 2, 24


def _buffer(streams: int, cap: int, seed: int, period: int = PERIOD, spec: sr.Spec = SPEC) -> sr.ReplayBuffer:
    return sr.ReplayBuffer(spec, num_streams=streams, stream_capacity=cap, window=WINDOW, period=period,
                           sampler="prioritized", alpha=0.7, seed=seed)


def _windows(buf: sr.ReplayBuffer) -> dict[tuple[int, int], tuple[tuple[int, ...], bytes, float]]:
    """Every drawable window: start (stream id, time) -> (unmasked times, h bytes at the start, leaf)."""
    storage = testing.shard(buf)._storage
    starts = np.flatnonzero(storage.valid)
    leaves = testing.leaf_masses(buf, starts)
    data, mask, _keys = storage.windows(starts)
    out = {}
    for i in range(starts.shape[0]):
        obs = data["obs"][i]
        out[(int(obs[0, 0]), int(obs[0, 1]))] = (tuple(obs[mask[i], 1].tolist()), data["h"][i, 0].tobytes(),
                                                 float(leaves[i]))
    return out


def _save(root: Path, m: int, spec: sr.Spec = SPEC, partial: str = "seal", end_last: bool = True) -> dict:
    before: dict = {}
    for k in range(m):
        local = _buffer(STREAMS, CAP, seed=k, spec=spec)
        rng = np.random.default_rng(40 + k)
        # Episodes closed (a save would seal an open one, closing windows), rings wrapped
        # (episodes whose head was overwritten keep their grid).
        write(local, timelines(rng, STREAMS, 70, p_abandon=0.0, end_last=end_last), rng, id_base=10 * k)
        batch = local.sample(64)
        local.update_priorities(batch.keys, rng.uniform(0.1, 3.0, 64).astype(np.float32))
        before.update(_windows(local))
        checkpoint.save(as_shard(local, k, m), root, 1, partial=partial)
    return before


def _normalised(windows: dict) -> dict:
    total = sum(w[2] for w in windows.values())
    return {k: (w[0], w[1], w[2] / total) for k, w in windows.items()}


@pytest.mark.parametrize("spec", [SPEC, START_SPEC], ids=["dense", "at_starts"])
@pytest.mark.parametrize(("m", "n"), [(2, 3), (2, 1)])
def test_m_to_n_keeps_starts_state_and_distribution(tmp_path: Path, m: int, n: int, spec: sr.Spec) -> None:
    before = _save(tmp_path, m, spec)
    after: dict = {}
    for k in range(n):
        local = _buffer(STREAMS, CAP * 3, seed=50 + k, spec=spec)
        load_shard(checkpoint.checkpoint_dir(tmp_path, 1), local, k, n)
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
        load_shard(checkpoint.checkpoint_dir(tmp_path, 1), target, 0, 1)
    assert len(target) == 0  # a failed load leaves the buffer empty


def _start_rows(directory: Path) -> list[int]:
    """Rows of ``field.h`` in each part of a checkpoint."""
    from shardreplay.checkpoint.refs import open_part

    manifest = checkpoint.load_manifest(directory)
    out = []
    for part in manifest.parts:
        with open_part(directory, part) as reader:
            out.append(reader.entry("field.h")[1][0])
    return out


def _state_bytes(start: tuple[int, int]) -> bytes:
    return state_of(np.array(start)).tobytes()


@pytest.mark.parametrize("partial", ["seal", "drop"])
def test_at_starts_parts_hold_start_rows_only_and_restore_as_saved(tmp_path: Path, partial: str) -> None:
    """Open episodes (sealed, or dropped with their start rows), an as-saved restore, and
    a restore onto a period that is a multiple of the saved one (2 -> 1 shard)."""
    before = _save(tmp_path, 2, START_SPEC, partial=partial, end_last=False)
    directory = checkpoint.checkpoint_dir(tmp_path, 1)
    verify(directory)  # the parts' shapes: start rows, not steps
    manifest = checkpoint.load_manifest(directory)
    rows = _start_rows(directory)
    assert all(n < part.steps / 2 for n, part in zip(rows, manifest.parts, strict=True))
    after: dict = {}
    for k in range(2):
        local = _buffer(STREAMS, CAP, seed=k, spec=START_SPEC)
        report = load_shard(directory, local, k, 2)
        assert report.exact == (partial == "seal")  # dropped steps: re-planned
        after.update(_windows(local))
    # Sealing closes open episodes (more windows end at the new LAST); dropping removes them.
    assert set(before) <= set(after) if partial == "seal" else set(after) <= set(before)
    assert after
    for start, (_times, state, _p) in after.items():  # bit for bit what the step wrote
        assert state == _state_bytes(start)
    coarse = _buffer(STREAMS, CAP * 3, seed=9, period=2 * PERIOD, spec=START_SPEC)
    load_shard(directory, coarse, 0, 1)
    windows = _windows(coarse)
    assert windows  # fewer starts (every 6 steps), each with its row
    assert all(state == _state_bytes(start) for start, (_t, state, _p) in windows.items())
    finer = _buffer(STREAMS, CAP * 3, seed=9, period=2, spec=START_SPEC)
    with pytest.raises(CheckpointError, match="period"):
        load_shard(directory, finer, 0, 1)
    assert len(finer) == 0


def test_at_starts_background_save_keeps_the_rows_at_the_call(tmp_path: Path) -> None:
    local = _buffer(STREAMS, CAP, seed=3, spec=START_SPEC)
    rng = np.random.default_rng(3)
    write(local, timelines(rng, STREAMS, 70, p_abandon=0.0, end_last=True), rng)
    before = _windows(local)
    pending = checkpoint.save_in_background(as_shard(local, 0, 1), tmp_path, 1)
    write(local, timelines(rng, STREAMS, 30), rng, id_base=50)  # overwrites steps the save holds
    pending.wait(60)
    again = _buffer(STREAMS, CAP, seed=3, spec=START_SPEC)
    load_shard(checkpoint.checkpoint_dir(tmp_path, 1), again, 0, 1)
    assert {k: v[:2] for k, v in _windows(again).items()} == {k: v[:2] for k, v in before.items()}
