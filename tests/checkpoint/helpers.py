"""Builders and probes shared by the checkpoint tests.

Every step carries a unique ``ctr`` = ``t * 10_000 + shard * 100 + row`` (``t`` the
write time, the same clock for every stream of a shard), so a restored step can be
traced back to where and when it was written; ``env`` is the stream id field (declared
``env_id``) and ``home`` keeps the original ``shard * 100 + row`` untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import shardreplay as sr
from shardreplay import checkpoint, testing
from shardreplay.buffer.shard import STEP_ARRAYS
from shardreplay.checkpoint.loading import load_shard
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.distributed.runner import InlineRunner
from shardreplay.distributed.sharded_buffer import ShardedInternals
from shardreplay.spec import StepType

FIRST, MID, LAST = int(StepType.FIRST), int(StepType.MID), int(StepType.LAST)
SPEC = sr.Spec({"obs": sr.Field((2,), np.float32), "ctr": sr.Field((), np.int64),
                "env": sr.Field((), np.int32, env_id=True), "home": sr.Field((), np.int32)})
ALPHA = 0.7
T_SCALE = 10_000


def make_buffer(num_streams: int, stream_capacity: int, *, window: int = 2,
                sampler: str = "prioritized", seed: int = 0, spec: sr.Spec = SPEC) -> sr.ReplayBuffer:
    """A buffer of the test spec."""
    return sr.ReplayBuffer(spec, num_streams=num_streams, stream_capacity=stream_capacity,
                           window=window, sampler=sampler, alpha=ALPHA, seed=seed)


def write_timelines(buf: sr.ReplayBuffer, timelines: list[list[int]], shard: int = 0,
                    discounts: list[list[float]] | None = None) -> None:
    """Write hand-made step-type timelines, one per stream, step by step (time-aligned)."""
    for t in range(max(len(tl) for tl in timelines)):
        rows = np.array([r for r, tl in enumerate(timelines) if t < len(tl)])
        types = np.array([timelines[r][t] for r in rows], np.uint8)
        disc = (np.array([discounts[r][t] for r in rows], np.float32) if discounts is not None
                else np.where(types == LAST, 0.0, 1.0).astype(np.float32))
        buf.add(_step(rows, t, shard, types, disc), stream_ids=rows)


def _step(rows: np.ndarray, t: int, shard: int, types: np.ndarray, disc: np.ndarray) -> dict[str, Any]:
    home = shard * 100 + rows
    return {"obs": np.stack([np.full(rows.shape, t), home], 1).astype(np.float32),
            "ctr": t * T_SCALE + home, "env": rows.astype(np.int32), "home": home.astype(np.int32),
            "step_type": types, "discount": disc}


def fill_random(buf: sr.ReplayBuffer, steps: int, *, shard: int = 0, seed: int = 0,
                p_end: float = 0.12, p_abandon: float = 0.03, update_rounds: int = 3, start: int = 0,
                ongoing: bool = False) -> None:
    """Random episodes in every stream (terminations, truncations, abandoned episodes,
    wrapped rings), random writer priorities, then a few rounds of priority updates.
    ``start``: the first write time (``ctr``); ``ongoing``: the streams' episodes go on
    from the steps before (else the first step starts one)."""
    rng = np.random.default_rng(seed)
    n = buf.num_streams
    prev = np.full(n, MID if ongoing else LAST)
    for t in range(start, start + steps):
        u = rng.random(n)
        types = np.where(prev == LAST, FIRST, np.where(u < p_end, LAST, MID))
        types = np.where((prev != LAST) & (u > 1 - p_abandon), FIRST, types).astype(np.uint8)
        disc = np.where((types == LAST) & (rng.random(n) < 0.5), 0.0, 1.0).astype(np.float32)
        prios = rng.uniform(0.05, 3.0, n).astype(np.float32)
        buf.add(_step(np.arange(n), t, shard, types, disc), priorities=prios)
        prev = types
    if buf.sampler_name != "prioritized":
        return
    for _ in range(update_rounds):
        if len(buf) == 0:
            break
        batch = buf.sample(16)
        buf.update_priorities(batch.keys, rng.uniform(0.0, 4.0, 16).astype(np.float32))


def window_table(buf: sr.ReplayBuffer) -> dict[int, tuple[tuple[int, ...], float]]:
    """Every drawable window of a shard: start ctr -> (ctrs of its unmasked steps, leaf).

    The leaf is the sampler's own tree leaf (``p^alpha``) for prioritized buffers, 1 for
    uniform ones; starts with leaf 0 cannot be drawn and are left out.
    """
    storage = testing.shard(buf)._storage
    starts = np.flatnonzero(storage.valid)
    if buf.sampler_name == "prioritized":
        leaves = testing.leaf_masses(buf, starts)
    else:
        leaves = np.ones(starts.shape[0])
    starts, leaves = starts[leaves > 0], leaves[leaves > 0]
    data, mask, _keys = storage.windows(starts)
    out = {}
    for i in range(starts.shape[0]):
        ctrs = tuple(int(c) for c in data["ctr"][i][mask[i]])
        out[ctrs[0]] = (ctrs, float(leaves[i]))
    return out


def union_distribution(tables: list[dict[int, tuple[tuple[int, ...], float]]]
                       ) -> dict[tuple[int, ...], float]:
    """The single-buffer distribution over the union of shards: window -> probability."""
    merged: dict[tuple[int, ...], float] = {}
    for table in tables:
        for ctrs, leaf in table.values():
            assert ctrs not in merged, f"window {ctrs} appears in two shards"
            merged[ctrs] = leaf
    total = sum(merged.values())
    return {k: v / total for k, v in merged.items()}


def assert_same_distribution(before: dict[tuple[int, ...], float],
                             after: dict[tuple[int, ...], float]) -> None:
    """Same windows (as step content), same probabilities (to float rounding)."""
    assert set(before) == set(after), (f"{len(set(before) - set(after))} windows lost, "
                                       f"{len(set(after) - set(before))} windows added")
    keys = sorted(before)
    np.testing.assert_allclose([after[k] for k in keys], [before[k] for k in keys], rtol=1e-9,
                               atol=0)


def stored_steps(buf: sr.ReplayBuffer) -> dict[str, np.ndarray]:
    """Stored steps in (row, time) order, with their row, as numpy arrays."""
    state = {k: v.numpy() for k, v in buf.state_dict()["arrays"].items()}
    rows = np.repeat(np.arange(buf.num_streams), state["row_length"])
    return {"row": rows, "ctr": state["field.ctr"], "env": state["field.env"],
            "home": state["field.home"], "step_type": state["step_type"],
            "discount": state["discount"], "priority": state["priority"],
            "episode_id": state["episode_id"]}


def step_multiset(buf: sr.ReplayBuffer) -> dict[int, float]:
    """ctr -> raw priority of every stored step."""
    s = stored_steps(buf)
    return dict(zip(s["ctr"].tolist(), s["priority"].tolist(), strict=True))


def as_shard(local: sr.ReplayBuffer, shard: int, num_shards: int) -> ShardedReplayBuffer:
    """A stand-in for rank ``shard`` of a ``num_shards`` group, for in-process saving.

    ``checkpoint.save`` needs only the local buffer, the rank and the world size (it calls
    no collective), so a process can write any shard's part without a process group.
    """
    stub = object.__new__(ShardedReplayBuffer)
    stub.local, stub.rank, stub.world_size = local, shard, num_shards
    # The state a part records beside the shard (internals_of(buffer).sharding_state()):
    # the shard-choice RNG, seeded as a real rank seeds it; nothing else is reached.
    rng = np.random.default_rng([0 if local.seed is None else local.seed, shard, 0x5EED])
    stub._internals = ShardedInternals(None, None, None, rng, InlineRunner(None, None), None)
    return stub


def episodes_of(buf_steps: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Indices of each episode run (same row, same episode id), independent of the library."""
    n = buf_steps["ctr"].shape[0]
    cut = np.ones(n, bool)
    cut[1:] = (buf_steps["episode_id"][1:] != buf_steps["episode_id"][:-1]) | \
              (buf_steps["row"][1:] != buf_steps["row"][:-1])
    starts = np.flatnonzero(cut)
    return np.split(np.arange(n), starts[1:])


def shard_arrays(local: sr.ReplayBuffer, *, trees: bool = False) -> dict[str, np.ndarray]:
    """A buffer's stored per-step arrays, fields and write positions; with ``trees`` also
    its sum and min trees (the leaves: each key's sampling mass)."""
    out = {name: testing.stored(local, name) for name in STEP_ARRAYS}
    out.update({f"field.{k}": testing.stored(local, k) for k in testing.shard(local).fields})
    out["pos"] = testing.positions(local)
    if trees:
        sums = testing.tree_sums(local)
        assert sums is not None
        out["tree.sums"], out["tree.mins"] = sums
    return out


def restored_arrays(root: Path, cid: int, n: int, num_streams: int, capacity: int, *,
                    trees: bool = False) -> list[dict[str, np.ndarray]]:
    """:func:`shard_arrays` of every one of ``n`` new shards restored in-process from
    checkpoint ``cid`` under ``root``."""
    out = []
    for rank in range(n):
        local = make_buffer(num_streams, capacity)
        load_shard(checkpoint.checkpoint_dir(root, cid), local, rank, n)
        out.append(shard_arrays(local, trees=trees))
    return out


def assert_arrays_equal(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]],
                        what: str = "") -> None:
    """Every shard's arrays in ``a`` equal ``b``'s, name for name (``what`` prefixes a failure)."""
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for name in x:
            np.testing.assert_array_equal(x[name], y[name], err_msg=f"{what}: {name}" if what else name)
