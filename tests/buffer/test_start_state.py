"""``at_starts`` fields (R2D2's recurrent state): kept once per window start, sampled at
the window's first step ``[B, 1, ...]`` bit for bit (docs/semantics.md, "Start-state
fields"). Checked against the dense field of the same writes and the value each step
wrote, over random streams (episode ends, abandoned episodes, wrapped rings, chunks and
single steps), through ``state_dict`` and in memory use. About 2 CPU-s."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import testing
from shardreplay.errors import ConfigError
from tests.support.sequences import FIRST, LAST, MID, SPEC, START_SPEC, state_of, timelines, write


def _pair(streams: int, cap: int, window: int, period: int, steps: int, seed: int
          ) -> tuple[sr.ReplayBuffer, sr.ReplayBuffer, list[list[int]]]:
    """A dense-state buffer and an at_starts one, given the same writes."""
    lines = timelines(np.random.default_rng(seed), streams, steps)
    bufs = []
    for spec in (SPEC, START_SPEC):
        buf = sr.ReplayBuffer(spec, num_streams=streams, stream_capacity=cap, window=window, period=period,
                              seed=seed)
        write(buf, lines, np.random.default_rng(seed + 1))
        bufs.append(buf)
    return bufs[0], bufs[1], lines


def _grid_steps(buf: sr.ReplayBuffer) -> np.ndarray:
    """Per row: the stored steps whose episode offset is on the period grid (numpy reference)."""
    storage = testing.shard(buf)._storage
    slots, lengths = storage.stored_slots()
    on = np.ones(slots.shape, bool) if buf.period == 1 else storage.episode_step[slots] % buf.period == 0
    return np.bincount(np.repeat(np.arange(lengths.shape[0]), lengths)[on], minlength=lengths.shape[0])


@pytest.mark.parametrize(("streams", "cap", "window", "period", "steps", "seed"),
                         [(3, 16, 5, 3, 90, 0), (2, 24, 8, 4, 200, 1), (1, 9, 4, 1, 40, 2),
                          (4, 12, 6, 6, 70, 3), (2, 40, 8, 2, 33, 4)])
def test_start_rows_match_the_dense_field(streams: int, cap: int, window: int, period: int, steps: int,
                                          seed: int) -> None:
    dense, starts, _lines = _pair(streams, cap, window, period, steps, seed)
    storage = testing.shard(starts)._storage
    np.testing.assert_array_equal(testing.valid(starts), testing.valid(dense))
    valid = np.flatnonzero(testing.valid(starts))
    assert valid.size
    got, mask, _keys = storage.windows(valid)
    want, want_mask, _ = testing.shard(dense)._storage.windows(valid)
    assert got["h"].shape == (valid.size, 1, 3)
    np.testing.assert_array_equal(got["h"][:, 0], want["h"][:, 0])  # bit for bit
    np.testing.assert_array_equal(got["h"][:, 0], state_of(got["obs"][:, 0]))
    np.testing.assert_array_equal(mask, want_mask)
    # One row per stored step on the grid, no more (the rings grew where episodes were short).
    store = storage.start_rows
    np.testing.assert_array_equal(store.live, _grid_steps(starts))
    assert int((store.ref >= 0).sum()) == int(_grid_steps(starts).sum())
    batch = starts.sample(64)
    assert batch.data["h"].shape == (64, 1, 3)
    np.testing.assert_array_equal(batch.data["h"][:, 0].numpy(), state_of(batch.data["obs"][:, 0].numpy()))
    seq = sr.sample_sequences(starts, 32, burn_in=1, state=("h",))
    np.testing.assert_array_equal(seq.start_state["h"].numpy(),
                                  state_of(seq.batch.data["obs"][:, 0].numpy()))


def test_state_dict_holds_start_rows_only_and_restores_them() -> None:
    _dense, buf, _lines = _pair(2, 16, 5, 3, 60, 7)
    state = buf.state_dict()
    assert state["arrays"]["field.h"].shape == (int(_grid_steps(buf).sum()), 3)
    assert state["arrays"]["field.obs"].shape[0] == buf.num_steps
    again = sr.ReplayBuffer(START_SPEC, num_streams=2, stream_capacity=16, window=5, period=3, seed=7)
    again.load_state_dict(state)
    more = timelines(np.random.default_rng(9), 2, 23)
    for b in (buf, again):  # the rings go on alike
        write(b, more, np.random.default_rng(10), id_base=0)
    valid = np.flatnonzero(testing.valid(buf))
    np.testing.assert_array_equal(valid, np.flatnonzero(testing.valid(again)))
    a = testing.shard(buf)._storage.windows(valid)[0]["h"]
    b = testing.shard(again)._storage.windows(valid)[0]["h"]
    np.testing.assert_array_equal(a, b)
    bad = dict(state["arrays"], **{"field.h": state["arrays"]["field.h"][1:]})
    with pytest.raises(ConfigError, match=r"field\.h"):
        again.load_state_dict({"meta": state["meta"], "arrays": bad})


def test_single_steps_take_the_full_path() -> None:
    """One step of every stream (the vector-env case) with period 1: no short path (it
    would write the field as a per-step column the storage does not have)."""
    buf = sr.ReplayBuffer(START_SPEC, num_streams=2, stream_capacity=8, window=2, sampler="prioritized")
    assert not testing.shard(buf).use_one_step()
    ids = np.arange(2)
    for t in range(20):
        obs = np.stack([ids, np.full(2, t)], -1)
        buf.add({"obs": obs, "h": state_of(obs), "step_type": np.full(2, 0 if t == 0 else 1, np.uint8)})
    batch = buf.sample(16)
    np.testing.assert_array_equal(batch.data["h"][:, 0].numpy(), state_of(batch.data["obs"][:, 0].numpy()))


def test_memory_per_stored_step_r2d2_sizes() -> None:
    """H=64 (h and c: 512 B per step dense), period 40: the start rows cost a few percent."""
    spec = {name: sr.Field((2, 64), np.float32, at_starts=at) for name, at in (("dense", False),
                                                                               ("starts", True))}
    bufs = {name: sr.ReplayBuffer(sr.Spec({"obs": sr.Field((4,)), "hc": f}), num_streams=4,
                                  stream_capacity=4000, window=80, period=40) for name, f in spec.items()}
    dense = testing.shard(bufs["dense"])._storage.fields["hc"].nbytes / bufs["dense"].capacity
    starts = testing.shard(bufs["starts"])._storage.start_rows.nbytes / bufs["starts"].capacity
    assert dense == 512
    assert starts < 40  # 512 / 40 per grid step, one row per 64-step episode, 8 B reference


def test_at_starts_is_refused_with_frame_stack_or_env_id() -> None:
    with pytest.raises(ConfigError, match="at_starts"):
        sr.Field((2, 3), np.uint8, frame_stack=True, at_starts=True)
    with pytest.raises(ConfigError, match="at_starts"):
        sr.Field((), np.int64, env_id=True, at_starts=True)
    assert sr.Field((3,), at_starts=True).to_dict()["at_starts"] is True
    assert "at_starts" not in sr.Field((3,)).to_dict()  # plain fields keep their fingerprint
    assert sr.Field.from_dict(sr.Field((3,), at_starts=True).to_dict()).at_starts


def test_memmap_rings_grow_as_files(tmp_path: Path) -> None:
    """Episodes of 1-3 steps need more start rows than the first rings hold: the rings
    grow (new files, the old ones removed) and keep every live row."""
    buf = sr.ReplayBuffer(START_SPEC, num_streams=2, stream_capacity=64, window=2, period=2,
                          storage="memmap", directory=tmp_path)
    store = testing.shard(buf)._storage.start_rows
    first = store.capacity
    lines = [[FIRST, MID, LAST] * 60 for _ in range(2)]
    write(buf, [line[:150] for line in lines], np.random.default_rng(0))
    assert store.capacity > first
    assert sorted(p.name for p in tmp_path.glob("starts.*")) == [f"starts.h.{store._grown}.bin"]
    valid = np.flatnonzero(testing.valid(buf))
    got = testing.shard(buf)._storage.windows(valid)[0]
    np.testing.assert_array_equal(got["h"][:, 0], state_of(got["obs"][:, 0]))
