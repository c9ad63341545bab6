"""Shared builders for the core tests: a fixed buffer with many valid starts, and snapshots."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from shardreplay import ReplayBuffer, testing
from shardreplay.spec.keys import unpack_keys
from tests.support.reference import FIRST, LAST, MID, SPEC

# Three streams of a fixed timeline; capacity 8, so stream 0 wraps and loses its head.
TIMELINES = (
    [FIRST, MID, MID, MID, LAST, FIRST, MID, MID, MID, MID, MID],
    [MID, MID, LAST, MID, MID, MID, FIRST, MID],
    [FIRST, MID, MID, MID, MID, LAST, FIRST],
)
CAPACITY = 8


def filled_buffer(window: int, **kwargs: Any) -> ReplayBuffer:
    """A buffer holding :data:`TIMELINES` (written step by step, streams interleaved)."""
    buf = ReplayBuffer(SPEC, num_streams=len(TIMELINES), stream_capacity=CAPACITY,
                       window=window, **kwargs)
    counter = 0
    for t in range(max(len(tl) for tl in TIMELINES)):
        rows = [r for r, tl in enumerate(TIMELINES) if t < len(tl)]
        n = len(rows)
        buf.add({"obs": np.array([[r, t] for r in rows], np.float32),
                 "act": np.arange(counter, counter + n, dtype=np.int64),
                 "step_type": np.array([TIMELINES[r][t] for r in rows]),
                 "discount": np.array([0.0 if TIMELINES[r][t] == LAST else 1.0 for r in rows])},
                stream_ids=np.array(rows))
        counter += n
    return buf


def flat_slots(buf: ReplayBuffer, keys: Any) -> np.ndarray:
    """Flat slots (row * C + slot) named by keys (their place field)."""
    keys = np.asarray(keys, np.int64)
    _, _tag, place, _ = unpack_keys(keys)
    return place


def all_keys(buf: ReplayBuffer) -> tuple[np.ndarray, np.ndarray]:
    """Every valid start's key and flat slot, found by sampling (with a uniform prior).

    The caller's buffer must have equal priorities everywhere, so every start is
    likely drawn; the result is checked to cover every valid slot.
    """
    batch = buf.sample(50 * len(buf) + 200)
    keys = np.unique(batch.keys.numpy())
    slots = flat_slots(buf, keys)
    assert sorted(slots.tolist()) == np.flatnonzero(testing.valid(buf)).tolist()
    return keys, slots


def snapshot(buf: ReplayBuffer) -> dict[str, Any]:
    """Everything observable about a buffer's state, deep-copied for comparison."""
    state = copy.deepcopy(buf.state_dict())
    extra = {"len": len(buf), "num_steps": buf.num_steps, "stale": buf.info().stale_updates,
             "valid": testing.valid(buf), "pos": testing.positions(buf),
             "raw": {n: a.copy() for n, a in testing.shard(buf).fields.items()}}
    tree = testing.tree_sums(buf)
    if tree is not None:
        extra["sums"], extra["mins"] = tree
        extra["max_priority"] = testing.sampler_counters(buf)["max_priority"]
    return {"state": state, "extra": extra}


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Deep equality of nested dicts / lists / arrays or tensors (NaN equals NaN), naming
    the path."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: not a tensor"
        a, b = a.numpy(), b.numpy()
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys differ"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), f"{path}: not an array"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: dtype/shape differ"
        np.testing.assert_array_equal(a, b, err_msg=path)
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{path}: {a!r} != {b!r}"
