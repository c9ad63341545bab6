"""Background saves: the checkpoint is the buffer at the call, however it is written meanwhile.

The writes that race the save overwrite the oldest rows (rings wrapped), so a save that
read the live slots late would hold the new steps; the fence's copy-on-overwrite keeps
the old ones. Restored bit-exact (same layout: every array, position, sampler and RNG
state), in one process and on two gloo ranks; a process SIGKILLed mid-write leaves the
previous checkpoint the newest complete one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

import shardreplay as sr
from shardreplay import checkpoint, testing
from shardreplay.buffer.fence import WriteFence
from shardreplay.distributed import ShardedReplayBuffer
from tests.support import run_ranks

SPEC = sr.Spec({"obs": sr.Field((64,), np.float32), "ctr": sr.Field((), np.int64),
                "env": sr.Field((), np.int32, env_id=True), "home": sr.Field((), np.int32)})
STREAMS, CAPACITY = 4, 300


def _buffer(seed: int) -> sr.ReplayBuffer:
    return sr.ReplayBuffer(SPEC, num_streams=STREAMS, stream_capacity=CAPACITY, window=2,
                           sampler="prioritized", alpha=0.7, seed=seed)


def _snapshot(buf: sr.ReplayBuffer) -> dict[str, Any]:
    """Everything a faithful restore puts back, copied (the key epoch moves on by design)."""
    state = buf.state_dict()
    meta = {k: v for k, v in state["meta"].items() if k != "key_epoch"}
    arrays = {k: v.numpy().copy() for k, v in state["arrays"].items()}
    return {"meta": meta, "arrays": arrays, "counters": testing.sampler_counters(buf)}


def _assert_same(restored: dict[str, Any], saved: dict[str, Any]) -> None:
    assert restored["meta"] == saved["meta"]
    mass = saved["counters"].pop("mass")  # the rebuilt sum tree adds in another order
    assert restored["counters"].pop("mass") == pytest.approx(mass, rel=1e-5)
    assert restored["counters"] == saved["counters"]
    assert restored["arrays"].keys() == saved["arrays"].keys()
    for name, arr in saved["arrays"].items():
        np.testing.assert_array_equal(restored["arrays"][name], arr, err_msg=name)


def _chunk(rng: np.random.Generator, t: int, n: int = 25) -> dict[str, np.ndarray]:
    """``n`` steps of every row: random episodes (terminations, truncations), every step
    unique (``ctr``)."""
    types = rng.choice(np.array([0, 1, 2], np.uint8), size=(STREAMS, n), p=[0.1, 0.8, 0.1])
    return {"obs": rng.normal(size=(STREAMS, n, 64)).astype(np.float32),
            "ctr": t * 100 + np.arange(STREAMS * n, dtype=np.int64).reshape(STREAMS, n) * 10**6,
            "env": np.repeat(np.arange(STREAMS, dtype=np.int32)[:, None], n, 1),
            "home": rng.integers(0, 99, (STREAMS, n)).astype(np.int32), "step_type": types,
            "discount": np.where(types == 2, rng.choice([0.0, 1.0]), 1.0).astype(np.float32)}


def fill_random(buf: sr.ReplayBuffer, steps: int, *, seed: int, shard: int = 0) -> None:
    """``steps`` steps in every row with random priorities, then priority updates."""
    rng = np.random.default_rng([seed, shard])
    for t in range(0, steps, 25):
        buf.extend(_chunk(rng, t), priorities=rng.uniform(0.05, 3.0, (STREAMS, 25)).astype(np.float32))
    for _ in range(3):
        batch = buf.sample(16)
        buf.update_priorities(batch.keys, rng.uniform(0.0, 4.0, 16).astype(np.float32))


def _overwrite(buf: sr.ReplayBuffer, seed: int, steps: int = CAPACITY) -> None:
    """``steps`` more steps in every row, in chunks: the oldest rows are replaced."""
    rng = np.random.default_rng(seed)
    for t in range(0, steps, 25):
        buf.extend(_chunk(rng, -t))


@pytest.mark.slow  # ~11 s on 2 busy cores (compiled kernels of a first write included)
def test_background_save_racing_overwrites_restores_the_buffer_at_the_call(tmp_path: Path) -> None:
    buf = _buffer(0)
    fill_random(buf, CAPACITY + 120, seed=1)  # rings wrapped: a row is written in two pieces
    saved = _snapshot(buf)
    pending = checkpoint.save_in_background(buf, tmp_path, 1, extra={"at": 1})
    fence = testing.shard(buf)._fence
    _overwrite(buf, seed=2)  # every fenced step is replaced while the thread writes
    assert pending.wait(60) == checkpoint.checkpoint_dir(tmp_path, 1)
    assert isinstance(fence, WriteFence) and fence.released
    assert testing.shard(buf)._fence is None
    restored = _buffer(5)
    report = checkpoint.load(tmp_path, restored)
    assert report.exact and report.extra == {"at": 1}
    _assert_same(_snapshot(restored), saved)
    # The buffer went on: a second save (the first one is finished) holds the new rows.
    checkpoint.save_in_background(buf, tmp_path, 2).wait(60)
    again = _buffer(6)
    checkpoint.load(tmp_path, again)
    _assert_same(_snapshot(again), _snapshot(buf))


def test_saves_of_one_shard_never_overlap(tmp_path: Path) -> None:
    buf = _buffer(0)
    fill_random(buf, 200, seed=3)
    first = checkpoint.save_in_background(buf, tmp_path, 1)
    at_second = _snapshot(buf)
    second = checkpoint.save_in_background(buf, tmp_path, 2)  # waits until the first is written
    # The first one's part and manifest are in place (its thread may not have returned yet).
    assert (first.directory / "manifest.json").exists()
    first.wait(60)
    _overwrite(buf, seed=4)
    second.wait(60)
    restored = _buffer(1)
    checkpoint.load(tmp_path, restored, checkpoint_id=2)
    _assert_same(_snapshot(restored), at_second)


def _rank_saves_in_background(rank: int, world: int, root: str) -> dict[str, Any]:
    local = _buffer(rank)
    fill_random(local, CAPACITY + 60 + 30 * rank, shard=rank, seed=10 + rank)
    buf = ShardedReplayBuffer(local, timeout_s=60)
    saved = _snapshot(local)
    pending = checkpoint.save_in_background(buf, root, 4)
    _overwrite(local, seed=20 + rank)
    pending.wait(60)
    dist.barrier()  # the other rank's part is written too
    fresh = ShardedReplayBuffer(_buffer(30 + rank), timeout_s=60)
    report = checkpoint.load(root, fresh)
    return {"saved": saved, "restored": _snapshot(fresh.local), "exact": report.exact}


@pytest.mark.distributed
@pytest.mark.slow  # one launch of two gloo ranks (~15 s)
def test_gloo_background_saves_restore_each_shard_as_at_the_call(tmp_path: Path) -> None:
    results = run_ranks(_rank_saves_in_background, 2, str(tmp_path))
    for r in results:
        assert r["exact"]
        _assert_same(r["restored"], r["saved"])


_CHILD = r"""
import os, sys, time
import numpy as np
import shardreplay as sr
from shardreplay import checkpoint

root = sys.argv[1]
spec = sr.Spec({"obs": sr.Field((4096,), np.uint8)})
buf = sr.ReplayBuffer(spec, num_streams=8, stream_capacity=3000, window=1, sampler="uniform", seed=0)
chunk = {"obs": np.full((8, 100, 4096), 7, np.uint8), "step_type": np.ones((8, 100), np.uint8)}
for _ in range(30):
    buf.extend(chunk)
checkpoint.save(buf, root, 1)
pending = checkpoint.save_in_background(buf, root, 2)
directory = checkpoint.checkpoint_dir(root, 2)
while True:  # the part's temporary file is being written: tell the parent
    tmp = [p for p in directory.glob(".part-*.tmp") if p.stat().st_size > 0] if directory.is_dir() else []
    if tmp:
        print("writing", flush=True)
        break
    buf.extend(chunk)
time.sleep(60)
"""


@pytest.mark.slow  # writes ~200 MB (a few seconds on a busy disk)
def test_sigkill_during_a_background_write_leaves_the_previous_checkpoint_newest(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "writing"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(30)
    assert checkpoint.checkpoint_dir(tmp_path, 2).is_dir()
    assert not checkpoint.is_complete(checkpoint.checkpoint_dir(tmp_path, 2))
    assert checkpoint.latest_complete(tmp_path) == 1
    spec = sr.Spec({"obs": sr.Field((4096,), np.uint8)})
    buf = sr.ReplayBuffer(spec, num_streams=8, stream_capacity=3000, window=1, sampler="uniform")
    report = checkpoint.load(tmp_path, buf)
    assert report.checkpoint_id == 1 and report.steps == 8 * 3000
    assert report.skipped and report.skipped[0].startswith("2:")
