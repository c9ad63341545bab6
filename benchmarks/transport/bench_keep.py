"""``train --keep-rollouts``: bytes per step kept against the replay buffer's, and the CPU
cost the archive adds to a shard's ingest (one JSON line).

Per case (CartPole vector steps from a random policy; 84x84 uint8 4-frame stacks of a
synthetic scene: a moving 8x8 block on a flat background with 1-bit noise, so LZ4's
ratio on them is optimistic next to Atari frames), chunks of 4 streams x 8 steps:

* ``kept_bytes_per_step``: a kept segment's bytes (80-byte record header + the chunk
  packed with LZ4: frames once, then compressed) per step;
* ``buffer_bytes_per_step``: what a full :class:`ReplayBuffer` holds (the larger of its
  traced allocations and the RSS it added) per step of its capacity (prioritized, window 4);
* ``ingest_cpu_us_per_chunk``: CPU time of one chunk's ingest as the learner does it
  (decode, ``buffer.extend``, ``IngestLog.append``): ``headers`` (the ``local`` log without
  the archive: headers only), ``raw`` (a durable medium's log: the chunk as received) and
  ``keep`` (the archive: the chunk packed with LZ4 when it came unpacked), rotated in one
  process, medians of ``--reps`` blocks; ``keep_extra_us_per_step`` against each. The log
  is not fsynced (a durable medium's once-a-second fdatasync is the same either way).
  Chunks come as the ``local`` ring gives them (unpacked: the archive packs them); on
  ``file://`` and ``redis://`` a frame-stacked spec's chunks come packed already
  (``--compression auto``), and the archive adds nothing to their ingest.
"""

from __future__ import annotations

import functools
import gc
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common

from shardreplay import Field, ReplayBuffer, Spec
from shardreplay.runtime.learner.wal import IngestLog, Retention
from shardreplay.transport.codec import Chunk, decode, encode, pack

S, T = 4, 8


def _vector_steps(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=0)
    out: dict[str, list[Any]] = {"obs": [], "action": [], "reward": [], "step_type": [], "discount": []}
    first = True
    for _ in range(n):
        action = int(rng.integers(2))
        out["obs"].append(obs)
        out["action"].append(action)
        obs, reward, term, trunc, _ = env.step(action)
        out["reward"].append(reward)
        out["step_type"].append(0 if first else (2 if term or trunc else 1))
        out["discount"].append(0.0 if term else 1.0)
        first = term or trunc
        if first:
            obs, _ = env.reset()
    dtypes = {"obs": np.float32, "action": np.int64, "reward": np.float32, "step_type": np.uint8,
              "discount": np.float32}
    return {k: np.asarray(v, dtypes[k]) for k, v in out.items()}


def _pixel_steps(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    frames = np.full((n + 3, 84, 84), 40, np.uint8)
    frames |= rng.integers(0, 2, frames.shape, dtype=np.uint8)
    for t in range(n + 3):
        y, x = 10 + (t * 3) % 64, 5 + (t * 5) % 70
        frames[t, y:y + 8, x:x + 8] = 200
    stacks = np.lib.stride_tricks.sliding_window_view(frames, 4, axis=0).transpose(0, 3, 1, 2)[:n]
    step_type = np.ones(n, np.uint8)
    step_type[0] = 0
    return {"obs": np.ascontiguousarray(stacks), "action": rng.integers(0, 6, n).astype(np.int64),
            "reward": np.zeros(n, np.float32), "step_type": step_type, "discount": np.ones(n, np.float32)}


def _case(name: str, chunks_n: int, rng: np.random.Generator) -> tuple[Spec, list[bytes]]:
    if name == "vector":
        spec = Spec({"obs": Field((4,), np.float32), "action": Field((), np.int64),
                     "reward": Field((), np.float32)})
        steps = _vector_steps(chunks_n * S * T, rng)
    else:
        spec = Spec({"obs": Field((4, 84, 84), np.uint8, frame_stack=True), "action": Field((), np.int64),
                     "reward": Field((), np.float32)})
        steps = _pixel_steps(chunks_n * T, rng)  # each stream replays the same trajectory
    wires = []
    for c in range(chunks_n):
        if name == "vector":
            part = {k: v[c * S * T:(c + 1) * S * T].reshape(S, T, *v.shape[1:]) for k, v in steps.items()}
        else:
            part = {k: np.stack([v[c * T:(c + 1) * T]] * S) for k, v in steps.items()}
        chunk = Chunk(actor_id=0, sequence=c, policy_version=0, stream_ids=np.arange(S, dtype=np.int64),
                      steps=part)
        wires.append(encode(chunk, spec))
    return spec, wires


def _buffer(spec: Spec, capacity: int) -> ReplayBuffer:
    return ReplayBuffer(spec, num_streams=S, stream_capacity=capacity // S, window=4, sampler="prioritized")


def _buffer_bytes_per_step(spec: Spec, wires: list[bytes], capacity: int) -> float:
    """Bytes a full buffer holds, per step: the larger of its numpy allocations
    (tracemalloc) and the resident memory it added (frame rings are mapped, not allocated
    through Python, so tracemalloc misses them; a small buffer may reuse freed pages, so
    RSS misses those)."""
    gc.collect()
    me = psutil.Process()
    base = me.memory_info().rss
    tracemalloc.start()
    buf = _buffer(spec, capacity)
    k = 0
    while buf.num_steps < capacity:
        ch = decode(wires[k % len(wires)], spec, max_bytes=1 << 30)
        buf.extend(ch.steps, stream_ids=ch.stream_ids)
        k += 1
    used = max(me.memory_info().rss - base, tracemalloc.get_traced_memory()[0])
    tracemalloc.stop()
    del buf
    return used / capacity


def _ingest(spec: Spec, wires: list[bytes], wal: IngestLog, buf: ReplayBuffer, seq0: int) -> float:
    t0 = time.process_time()
    for i, w in enumerate(wires):
        ch = decode(w, spec, max_bytes=1 << 30)
        buf.extend(ch.steps, stream_ids=ch.stream_ids)
        wal.append([(memoryview(w), 0, seq0 + i, seq0 + i - 1, S * T)])
    return (time.process_time() - t0) / len(wires) * 1e6


def run_case(name: str, chunks_n: int, reps: int, capacity: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    spec, wires = _case(name, chunks_n, rng)
    tmp = Path(tempfile.mkdtemp(prefix="bench_keep-"))
    try:
        keep = Retention(tmp / "rollouts", 0, pack=functools.partial(pack, spec=spec, codec="lz4"))
        logs = {"headers": IngestLog(tmp / "h", 0, 1, fsync=False, keep_chunks=False),
                "raw": IngestLog(tmp / "a", 0, 1, fsync=False),
                "keep": IngestLog(tmp / "b", 0, 1, fsync=False, retention=keep)}
        bufs = {k: _buffer(spec, capacity) for k in logs}
        times: dict[str, list[float]] = {k: [] for k in logs}
        order = list(logs)
        for r in range(reps):
            for k in order[r % 3:] + order[:r % 3]:  # each variant first, second and last in turn
                times[k].append(_ingest(spec, wires, logs[k], bufs[k], r * len(wires)))
        kept_bytes = logs["keep"].segment_bytes / (reps * len(wires) * S * T)
        wire_bytes = sum(len(w) for w in wires) / (len(wires) * S * T)
        for log in logs.values():
            log.close()
        med = {k: float(np.median(v)) for k, v in times.items()}
        return {"case": name, "chunk_steps": S * T, "wire_bytes_per_step": round(wire_bytes, 1),
                "kept_bytes_per_step": round(kept_bytes, 1),
                "buffer_bytes_per_step": round(_buffer_bytes_per_step(spec, wires, capacity), 1),
                "ingest_cpu_us_per_chunk": {k: round(v, 1) for k, v in med.items()},
                "keep_extra_us_per_step": {k: round((med["keep"] - med[k]) / (S * T), 2)
                                           for k in ("headers", "raw")}}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = common.parser(__doc__, quick="fewer chunks and repetitions", reps=7)
    args = p.parse_args()
    chunks_n = 20 if args.quick else 200
    cases = [run_case("vector", chunks_n, 3 if args.quick else args.reps, 4096 if args.quick else 65536),
             run_case("pixels", chunks_n // 2, 3 if args.quick else args.reps, 1024 if args.quick else 8192)]
    common.emit_line({"bench": "keep_rollouts", "load": common.loadavg(), "cpus": common.cpus(),
                      "commit": common.commit(), "cases": cases}, args.out)


if __name__ == "__main__":
    main()
