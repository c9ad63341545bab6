"""The write fence: fenced steps read back as they were at the fence, whichever comes
first (the reader or a write replacing them), each copied aside at most once."""

from __future__ import annotations

import numpy as np

import shardreplay as sr
from shardreplay import testing

STREAMS, CAP = 3, 50


def _buffer() -> sr.ReplayBuffer:
    spec = sr.Spec({"obs": sr.Field((8,), np.float32), "a": sr.Field((), np.int64)})
    return sr.ReplayBuffer(spec, num_streams=STREAMS, stream_capacity=CAP, window=1, sampler="uniform")


def _write(buf: sr.ReplayBuffer, steps: int, base: int) -> None:
    for t in range(0, steps, 10):
        v = base + t + np.arange(10)[None, :] + 1000 * np.arange(STREAMS)[:, None]
        buf.extend({"obs": np.repeat(v[..., None], 8, -1).astype(np.float32), "a": v.astype(np.int64),
                    "step_type": np.ones((STREAMS, 10), np.uint8)})


def _rows(buf: sr.ReplayBuffer, name: str) -> list[np.ndarray]:
    """Each row's stored steps of ``name`` in time order."""
    arrays = buf.state_dict()["arrays"]
    return np.split(arrays[f"field.{name}"].numpy().copy(), np.cumsum(arrays["row_length"].numpy())[:-1])


def test_fenced_steps_read_as_at_the_fence_while_writes_replace_them() -> None:
    buf = _buffer()
    _write(buf, 70, 0)  # wrapped: the oldest steps are the next ones replaced
    shard = testing.shard(buf)
    before = {name: _rows(buf, name) for name in ("obs", "a")}
    start = testing.positions(buf) - np.minimum(testing.positions(buf), CAP) + 5  # the first 5 not needed
    fence = shard.take_fence(["obs", "a"], start)
    pieces = {name: fence.pieces(name) for name in ("obs", "a")}
    read = {name: [np.asarray(p) for p in ps[:1]] for name, ps in pieces.items()}  # row 0 read first
    _write(buf, 30, 10_000)  # replaces 30 of each row's 50 fenced steps
    # Rows 1 and 2: steps 5..30 of each field copied aside (row 0 was read: nothing to copy).
    assert fence.copied_steps == 2 * (STREAMS - 1) * 25
    read = {name: read[name] + [np.asarray(p) for p in ps[1:]] for name, ps in pieces.items()}
    _write(buf, 60, 20_000)  # everything replaced, all of it read already: nothing copied
    assert fence.copied_steps == 2 * (STREAMS - 1) * 25
    for name in ("obs", "a"):
        got = np.concatenate(read[name])
        want = np.concatenate([row[5:] for row in before[name]])
        np.testing.assert_array_equal(got, want, err_msg=name)
    shard.release_fence(fence)
    assert shard._fence is None and fence.released
