"""Frame-stacked fields: each frame stored once, stacks rebuilt bit for bit at sample time.

Every test writes the same steps into a buffer whose observation is ``frame_stack`` and
into one with plain storage, with the same seed, and compares what they sample.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import checkpoint, testing
from shardreplay.checkpoint import loading as loading_ckpt
from shardreplay.errors import SpecMismatchError
from shardreplay.spec.keys import TAG_MASK, TAG_SHIFT
from shardreplay.storage import frames
from shardreplay.storage.frames import initial_frame_capacity

K = 4
FRAME = (3, 5)


def specs() -> tuple[sr.Spec, sr.Spec]:
    """The stacked spec and the same spec with plain storage."""
    fields: dict[str, Any] = {"act": sr.Field((), np.int64), "rew": sr.Field((), np.float32)}
    return (sr.Spec({"obs": sr.Field((K, *FRAME), np.uint8, frame_stack=True), **fields}),
            sr.Spec({"obs": sr.Field((K, *FRAME), np.uint8), **fields}))


class Envs:
    """``S`` environments with a frame-stacking wrapper: a reset stack repeats the first
    frame (or is zeros, on every third reset), each step shifts one new frame in."""

    def __init__(self, num_streams: int, seed: int, p_done: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.s, self.p_done = num_streams, p_done
        self.stack = np.zeros((num_streams, K, *FRAME), np.uint8)
        self.ended = np.ones(num_streams, bool)
        self.resets = 0
        self.t = 0

    def step(self) -> dict[str, np.ndarray]:
        """One step of every environment."""
        done = self.rng.random(self.s) < self.p_done
        types = np.where(self.ended, 0, np.where(done, 2, 1)).astype(np.uint8)
        frame = self.rng.integers(0, 256, (self.s, *FRAME), dtype=np.uint8)
        for s in range(self.s):
            if types[s] == 0:
                self.resets += 1
                self.stack[s] = 0 if self.resets % 3 == 0 else frame[s][None]
                self.stack[s, -1] = frame[s]
            else:
                self.stack[s] = np.concatenate([self.stack[s, 1:], frame[s][None]])
        self.ended = types == 2
        self.t += 1
        return {"obs": self.stack.copy(), "act": np.full(self.s, self.t), "rew": self.rng.random(self.s),
                "step_type": types, "discount": np.where(types == 2, 0.0, 1.0)}

    def chunk(self, t_len: int) -> dict[str, np.ndarray]:
        """``t_len`` steps of every environment, ``[S, T, ...]``."""
        steps = [self.step() for _ in range(t_len)]
        return {k: np.stack([s[k] for s in steps], axis=1) for k in steps[0]}


def pair(num_streams: int, cap: int, **kwargs: Any) -> tuple[sr.ReplayBuffer, sr.ReplayBuffer]:
    stacked, plain = specs()
    return (sr.ReplayBuffer(stacked, num_streams=num_streams, stream_capacity=cap, **kwargs),
            sr.ReplayBuffer(plain, num_streams=num_streams, stream_capacity=cap, **kwargs))


def assert_same_samples(a: sr.ReplayBuffer, b: sr.ReplayBuffer, n: int = 64, rounds: int = 3) -> None:
    assert len(a) == len(b) and a.num_steps == b.num_steps
    for _ in range(rounds):
        x, y = a.sample(n), b.sample(n)
        assert x.data.keys() == y.data.keys()
        for name in x.data:
            assert x.data[name].dtype == y.data[name].dtype
            assert np.array_equal(x.data[name].numpy(), y.data[name].numpy()), name
        for name in ("mask", "weights", "probabilities"):
            assert np.array_equal(getattr(x, name).numpy(), getattr(y, name).numpy()), name
        assert np.array_equal(_untagged(x.keys.numpy()), _untagged(y.keys.numpy()))


def _untagged(keys: np.ndarray) -> np.ndarray:
    """Keys without the buffer tag: two buffers differ only there."""
    return keys & ~np.int64(TAG_MASK << TAG_SHIFT)


@pytest.mark.parametrize(("sampler", "window", "frame"),
                         [("uniform", 2, (3, 5)), ("prioritized", 4, (3, 5)), ("uniform", 1, (3, 5)),
                          ("prioritized", 3, (8, 6))])  # 48-byte frames: streamed to aligned output
def test_samples_equal_plain_storage_across_episodes_and_wrap_around(
        sampler: str, window: int, frame: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "FRAME", frame)
    stacked, plain = pair(3, 17, window=window, sampler=sampler, seed=5)
    envs = Envs(3, seed=1, p_done=0.12)
    chunk_rng = np.random.default_rng(2)
    for i in range(40):  # ~10 wraps of each ring, adds and chunks of 1..17 steps
        steps = envs.step() if i % 2 else envs.chunk(int(chunk_rng.integers(1, 18)))
        (stacked.add if i % 2 else stacked.extend)(steps)
        (plain.add if i % 2 else plain.extend)(steps)
        if i % 5 == 4:
            assert_same_samples(stacked, plain)
    assert envs.resets > 20


def test_some_streams_at_a_time() -> None:
    stacked, plain = pair(4, 9, window=3, seed=0)
    envs = [Envs(1, seed=s, p_done=0.3) for s in range(4)]
    rng = np.random.default_rng(4)
    for _ in range(60):
        rows = np.sort(rng.choice(4, size=int(rng.integers(1, 5)), replace=False)).astype(np.int64)
        steps = [envs[r].step() for r in rows.tolist()]
        part = {k: np.concatenate([s[k] for s in steps]) for k in steps[0]}
        stacked.add(part, stream_ids=rows)
        plain.add(part, stream_ids=rows)
    assert_same_samples(stacked, plain)


def test_a_stack_that_does_not_continue_its_episode_is_rejected_and_nothing_changes() -> None:
    stacked, plain = pair(2, 8, seed=0)
    envs = Envs(2, seed=0, p_done=0.0)
    for _ in range(5):
        step = envs.step()
        stacked.add(step)
        plain.add(step)
    good = envs.step()
    bad = {k: v.copy() for k, v in good.items()}
    bad["obs"][1, 0] ^= 1  # stream 1's oldest frame is not the previous stack's second
    with pytest.raises(SpecMismatchError, match="stream 1 at step 5"):
        stacked.add(bad)
    stacked.add(good)
    plain.add(good)
    chunk = envs.chunk(3)
    chunk["obs"][0, 2, 1] ^= 1  # inside a chunk: stream 0's third step
    before = stacked.state_dict()
    with pytest.raises(SpecMismatchError, match="stream 0 at step 8"):
        stacked.extend(chunk)
    after = stacked.state_dict()
    for name, arr in before["arrays"].items():
        assert np.array_equal(arr, after["arrays"][name]), name
    assert_same_samples(stacked, plain)
    # The same stacks are accepted where an episode starts.
    chunk["step_type"][0, 2] = 0
    stacked.extend(chunk)
    plain.extend(chunk)
    assert_same_samples(stacked, plain)


def test_each_frame_is_stored_once_and_rings_grow_for_short_episodes() -> None:
    stacked, plain = pair(2, 64, seed=0)
    store = testing.shard(stacked)._storage.stacked["obs"]
    assert store.frame_capacity == initial_frame_capacity(64, K) == 64 + 3
    envs = Envs(2, seed=0, p_done=0.0)
    for _ in range(100):
        step = envs.step()
        stacked.add(step)
        plain.add(step)
    assert store.fpos.tolist() == [100 + K - 1] * 2  # one reset stack, then one frame a step
    assert store.frame_capacity == 64 + 3  # no growth
    assert "obs" not in testing.shard(stacked).fields  # no [S*C, K, ...] array
    ring = store.frames.ctypes.data
    envs.p_done = 0.9  # episodes of one or two steps: a reset stack every other step
    for _ in range(100):
        step = envs.step()
        stacked.add(step)
        plain.add(step)
    assert store.frame_capacity > 64 + 3
    assert store.frames.ctypes.data == ring  # wrapped rings grown in place (frames moved within)
    assert_same_samples(stacked, plain)


def test_rings_that_have_not_wrapped_grow_without_moving_a_frame() -> None:
    """The first fill of a buffer of short episodes: each growth only lengthens the
    rings' views of one allocation made at the start (no copy, no new memory), by a
    little: the rings end within 1/SLACK of the frames they hold (their unused tail would
    be paged in after the fill)."""
    stacked, plain = pair(2, 64, seed=0)
    store = testing.shard(stacked)._storage.stacked["obs"]
    ring = store.frames.ctypes.data
    envs = Envs(2, seed=3, p_done=0.6)
    sizes = {store.frame_capacity}
    for _ in range(60):  # fewer steps than the capacity: nothing overwritten yet
        step = envs.step()
        stacked.add(step)
        plain.add(step)
        sizes.add(store.frame_capacity)
        assert store.fpos.max() <= store.frame_capacity  # no ring wrapped
    assert len(sizes) >= 3 and store.frames.ctypes.data == ring  # grown twice, in place
    held = int(store.fpos.max())
    assert held <= store.frame_capacity <= held + held // frames.SLACK
    assert_same_samples(stacked, plain)


def test_memory_mapped_rings_and_validated_chunks(tmp_path: Path) -> None:
    stacked_spec, plain_spec = specs()
    stacked = sr.ReplayBuffer(stacked_spec, num_streams=2, stream_capacity=16, seed=4, storage="memmap",
                              directory=tmp_path)
    plain = sr.ReplayBuffer(plain_spec, num_streams=2, stream_capacity=16, seed=4)
    envs = Envs(2, seed=8, p_done=0.7)  # short episodes: the rings grow
    for _ in range(12):
        chunk = envs.chunk(5)
        stacked.extend(stacked.spec.validated(chunk, (2, 5)))  # read-only arrays, as decoded chunks
        plain.extend(chunk)
    assert testing.shard(stacked)._storage.stacked["obs"].frame_capacity > initial_frame_capacity(16, K)
    assert sorted(p.name for p in tmp_path.glob("frames.*")) == ["frames.obs.bin"]  # grown in place
    assert_same_samples(stacked, plain)


@pytest.mark.parametrize("partial", ["seal", "drop"])
def test_state_dict_and_checkpoints_round_trip(tmp_path: Path, partial: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Small pieces: a save builds stacks 7 steps at a time, a load reads 5 at a time.
    monkeypatch.setattr(frames, "PIECE_STEPS", 7)
    monkeypatch.setattr(loading_ckpt, "PIECE_STEPS", 5)
    stacked, plain = pair(3, 12, window=3, sampler="prioritized", seed=7)
    envs = Envs(3, seed=5, p_done=0.15)
    for _ in range(10):
        chunk = envs.chunk(5)
        stacked.extend(chunk)
        plain.extend(chunk)
    views = testing.shard(stacked).export()["arrays"]["field.obs"]
    assert [p.shape[0] for p in views] == [7] * 5 + [1]  # 36 steps, built lazily
    assert np.array_equal(np.concatenate(views), stacked.state_dict()["arrays"]["field.obs"])
    # Same layout: the saved slots; another layout (2 streams): episodes placed anew.
    checkpoint.save(stacked, tmp_path / "s", 1, partial=partial)
    checkpoint.save(plain, tmp_path / "p", 1, partial=partial)
    state = stacked.state_dict()
    assert state["arrays"]["field.obs"].shape == (36, K, *FRAME)  # whole stacks, as plain fields
    again, _ = pair(3, 12, window=3, sampler="prioritized", seed=1)
    again.load_state_dict(state)
    assert_same_samples(again, plain, rounds=1)
    for streams in (3, 2):
        a, b = pair(streams, 12 if streams == 3 else 20, window=3, sampler="prioritized", seed=3)
        checkpoint.load(tmp_path / "s", a)
        checkpoint.load(tmp_path / "p", b)
        assert_same_samples(a, b)
        if streams == 3 and partial == "seal":  # a faithful resume goes on with the episodes
            chunk = envs.chunk(4)
            a.extend(chunk)
            b.extend(chunk)
            assert_same_samples(a, b)


@pytest.mark.parametrize("frame", [(3, 5), (8, 6)])
def test_windows_into_packed_records_match_windows(frame: tuple[int, int],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "FRAME", frame)
    stacked, _plain = pair(2, 10, window=2, seed=0)
    envs = Envs(2, seed=9, p_done=0.2)
    for _ in range(25):
        stacked.add(envs.step())
    storage = testing.shard(stacked)._storage
    starts = testing.shard(stacked).draw(16).starts
    data, mask, keys = storage.windows(starts)
    obs_bytes = data["obs"][0].nbytes
    out = np.zeros((20, 16 + obs_bytes), np.uint8)
    rows = np.arange(16, dtype=np.int64)[::-1].copy()
    got_mask, got_keys = storage.windows_into(starts, out, {"act": 0, "obs": 16}, rows)
    assert np.array_equal(got_mask, mask) and np.array_equal(got_keys, keys)
    got = out[rows, 16:].reshape(16, 2, K, *FRAME)
    assert np.array_equal(got, data["obs"])


def test_plain_field_descriptions_are_unchanged() -> None:
    assert "frame_stack" not in sr.Field((3,), np.float32).to_dict()
    field = sr.Field((K, *FRAME), np.uint8, frame_stack=True)
    assert field.to_dict()["frame_stack"] is True
    assert sr.Field.from_dict(field.to_dict()) == field
    stacked, plain = specs()
    assert stacked.fingerprint != plain.fingerprint
    with pytest.raises(sr.errors.ConfigError, match="frame_stack"):
        sr.Field((4,), np.uint8, frame_stack=True)


@pytest.mark.parametrize("frame", [(3, 5), (8, 6)])
def test_sharded_exchange_records_carry_whole_stacks(frame: tuple[int, int],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from shardreplay.spec.layout import DATA, window_layout

    monkeypatch.setattr(sys.modules[__name__], "FRAME", frame)
    stacked, plain = pair(3, 11, window=3, seed=2)
    envs = Envs(3, seed=6, p_done=0.25)
    for _ in range(40):
        step = envs.step()
        stacked.add(step)
        plain.add(step)
    starts = testing.shard(stacked).draw(50, advance_schedule=False).starts
    records = {}
    for buf in (stacked, plain):
        layout = window_layout(buf.spec, 3)
        out = np.zeros((60, layout.record_bytes), np.uint8)
        rows = np.random.default_rng(1).permutation(60)[:50]
        testing.shard(buf).gather(starts, into=(out, layout.offsets(DATA), rows))
        records[buf is stacked] = layout.views(out)
    for name in ("data.obs", "data.act", "data.rew", "data.step_type"):
        assert np.array_equal(records[True][name], records[False][name]), name


def test_chunks_from_the_wire_go_into_a_frame_stacked_buffer() -> None:
    from shardreplay.transport.codec import Chunk, decode, encode

    stacked_spec, _plain_spec = specs()
    stacked, plain = pair(2, 10, window=2, seed=3)
    envs = Envs(2, seed=4, p_done=0.2)
    for seq in range(6):
        steps = envs.chunk(4)
        data = encode(Chunk(0, seq, 0, np.arange(2, dtype=np.int64), steps), stacked_spec)
        chunk = decode(data, stacked_spec, max_bytes=1 << 20)
        stacked.extend(chunk.steps, stream_ids=chunk.stream_ids)
        plain.extend(steps)
    assert_same_samples(stacked, plain)


def test_rings_never_grow_beyond_a_stack_per_step() -> None:
    stacked, plain = pair(2, 6, window=1, seed=0)
    envs = Envs(2, seed=2, p_done=0.0)
    for _ in range(30):
        envs.ended[:] = True  # every step FIRST: a whole stack each
        step = envs.step()
        stacked.add(step)
        plain.add(step)
    assert testing.shard(stacked)._storage.stacked["obs"].frame_capacity == K * 6
    assert_same_samples(stacked, plain)
    for _ in range(10):
        step = envs.step()
        stacked.add(step)
        plain.add(step)
    assert_same_samples(stacked, plain)


def test_an_empty_frame_stacked_buffer_exports_and_loads_its_state() -> None:
    """No stored steps: the stacks export as an empty [0, K, *frame] array (gathering no
    slots used to fail in numpy's reshape), and load back."""
    spec = sr.Spec({"obs": sr.Field((3, 2, 4), np.uint8, frame_stack=True)})
    buf = sr.ReplayBuffer(spec, num_streams=2, stream_capacity=4)
    state = buf.state_dict()
    assert tuple(state["arrays"]["field.obs"].shape) == (0, 3, 2, 4)
    other = sr.ReplayBuffer(spec, num_streams=2, stream_capacity=4)
    other.load_state_dict(state)
    assert other.num_steps == 0


def test_rings_reserved_for_more_frames_than_the_machine_has_memory() -> None:
    """The rings' one allocation holds K frames per step (the worst case: 1M steps of
    84x84x4 reserve 26 GiB). It reserves address space only, so it is made on a machine
    with less memory (``np.zeros`` refused it: MemoryError under Linux's default
    overcommit), and only the frames written take memory."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    frame = (256, 256)  # large frames: few steps (arrays per step stay small)
    cap = 2 * ram // (K * frame[0] * frame[1]) + 1  # the reserve: twice the machine's memory
    spec = sr.Spec({"obs": sr.Field((K, *frame), np.uint8, frame_stack=True), "act": sr.Field((), np.int64),
                    "rew": sr.Field((), np.float32)})
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    buf = sr.ReplayBuffer(spec, num_streams=1, stream_capacity=cap, seed=0)
    store = testing.shard(buf)._storage.stacked["obs"]
    assert store._reserve.nbytes > ram
    stack = np.arange(K * frame[0] * frame[1], dtype=np.int64).astype(np.uint8).reshape(1, K, *frame)
    written = []
    for t in range(20):
        buf.add({"obs": stack, "act": np.array([t]), "rew": np.zeros(1, np.float32),
                 "step_type": np.array([0 if t == 0 else 1], np.uint8)})
        written.append(stack[0])
        stack = np.concatenate([stack[:, 1:], stack[:, :1] + 1], axis=1)
    np.testing.assert_array_equal(store.gather(np.arange(20)), np.stack(written))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 2**20  # KiB: under 1 GiB more
