"""The learner's stall during a checkpoint, and the bytes of an incremental one
(``bench_checkpoint.py --stall``).

A learner step here is what the training loop does with its shard each iteration:
ingest one actor chunk (``extend`` of 8 streams x ``INGEST_T`` Atari steps, which
overwrites the oldest rows of the full rings), draw a batch of 64 windows and update
their priorities. Steps are timed:

* ``baseline``: no checkpoint;
* ``sync`` (before: what ``train`` did): one step also calls ``checkpoint.save``, so it
  waits for the whole write;
* ``background`` (now): one step calls ``checkpoint.save_in_background``; the steps go on
  while the forked child writes, and every step until it is written counts as *during* it.
  An untimed background save comes first, as in a run, whose later saves fork a parent
  whose memory the earlier ones' copy on write has changed.

Longest step during the checkpoint against the median step without one (target: at most
the median + 50 ms), and the longest ``extend`` during it (ingest is never blocked on
the write: an ``extend`` pays at most the copy on write of the pages it writes). Then as many
steps again without a checkpoint (``after_*``): on a shared machine a window of
thousands of steps has its own rare long steps, save or not.

``--frame-stack`` stores ``obs`` as a frame-stacked field (``Field((4, 84, 84), uint8,
frame_stack=True)``, as Atari runs do): each stream plays a cyclic sequence of random
frames, so every chunk's stacks continue the stream's previous step (one new frame per
step) and the frame rings never grow while timed.

Then the incremental figure: a full (first) incremental save, ``--ingest-frac`` of the
capacity ingested, and the next incremental save: bytes it wrote (its part file and
description) against the bytes of the steps ingested since the previous one (target
<= 1.1), and against a full part.
"""

from __future__ import annotations

import resource
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

INGEST_T = 8
BATCH = 64
TARGET_STALL_S = 0.050
TARGET_INCREMENTAL = 1.1


class FrameCycle:
    """Stacks of ``K`` frames of a cyclic sequence of ``period`` random frames per stream:
    the stack at step ``p`` holds frames ``p-K+1 .. p`` (mod ``period``), so consecutive
    steps continue each other's stacks whatever chunks they are written in."""

    def __init__(self, streams: int, obs_shape: tuple[int, ...], period: int = 64, seed: int = 7) -> None:
        self.k = obs_shape[0]
        self.period = period
        self.frames = np.random.default_rng(seed).integers(0, 256, (streams, period, *obs_shape[1:]),
                                                           dtype=np.uint8)

    def obs(self, start: int, n: int) -> np.ndarray:
        """``[streams, n, K, *frame]``: the stacks of steps ``start .. start+n-1``."""
        at = (np.arange(start, start + n)[:, None] + np.arange(1 - self.k, 1)[None, :]) % self.period
        return self.frames[:, at]


class Learner:
    """The shard side of a learner step (see the module docstring). With ``frames``, the
    chunks continue those stacks from step ``start`` of every stream (``start`` and the
    cycle's period multiples of ``INGEST_T``: the chunks repeat, precomputed)."""

    def __init__(self, buf: Any, streams: int, obs_shape: tuple[int, ...],
                 frames: FrameCycle | None = None, start: int = 0) -> None:
        self.buf = buf
        rng = np.random.default_rng(1)
        self.rng = rng
        self.chunk = {"obs": rng.integers(0, 255, (streams, INGEST_T, *obs_shape), dtype=np.uint8),
                      "action": rng.integers(0, 18, (streams, INGEST_T)),
                      "reward": rng.random((streams, INGEST_T), dtype=np.float32),
                      "step_type": np.ones((streams, INGEST_T), np.uint8)}
        self.chunks = [self.chunk]
        if frames is not None:
            assert start % INGEST_T == 0 and frames.period % INGEST_T == 0
            starts = range(start, start + frames.period, INGEST_T)
            self.chunks = [{**self.chunk, "obs": np.ascontiguousarray(frames.obs(t, INGEST_T))}
                           for t in starts]
        self.n = 0
        self.extend_s: list[float] = []
        self.parts: list[tuple[float, float, float]] = []  # (extend, sample, update) of each step
        # Per step: this thread's CPU seconds, page faults and involuntary context switches
        # (a long step with little CPU waited: for a core, the host, or a lock).
        self.costs: list[tuple[float, int, int]] = []

    def step(self) -> float:
        """One step; returns its seconds (the ``extend`` alone goes to ``extend_s``, the
        three parts to ``parts``)."""
        chunk = self.chunks[self.n % len(self.chunks)]
        self.n += 1
        before, cpu = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time()
        started = time.perf_counter()
        self.buf.extend(chunk)
        extended = time.perf_counter()
        self.extend_s.append(extended - started)
        batch = self.buf.sample(BATCH)
        sampled = time.perf_counter()
        self.buf.update_priorities(batch.keys, self.rng.uniform(0.01, 2.0, BATCH).astype(np.float32))
        ended = time.perf_counter()
        self.parts.append((extended - started, sampled - extended, ended - sampled))
        after = resource.getrusage(resource.RUSAGE_THREAD)
        self.costs.append((time.thread_time() - cpu, after.ru_minflt + after.ru_majflt - before.ru_minflt
                           - before.ru_majflt, after.ru_nivcsw - before.ru_nivcsw))
        return ended - started


def _steps(learner: Learner, n: int) -> list[float]:
    return [learner.step() for _ in range(n)]


def measure_stall(buf: Any, root: Path, streams: int, obs_shape: tuple[int, ...],
                  steps: int, learner: Learner | None = None) -> dict[str, Any]:
    """Baseline, sync and background phases (see the module docstring); ``learner``
    (default: plain chunks) steps the buffer."""
    from shardreplay import checkpoint

    learner = learner or Learner(buf, streams, obs_shape)
    _steps(learner, 20)  # warm: kernels, caches
    # A run's saves after its first: the steps during that one split the huge pages they
    # wrote (copy on write), which the next fork pays for unless they are regrouped.
    shutil.rmtree(root, ignore_errors=True)
    first = checkpoint.save_in_background(buf, root, 0, keep_last=None)
    while not first.done():
        learner.step()
    first.wait()
    baseline = _steps(learner, steps)
    median = statistics.median(baseline)
    shutil.rmtree(root, ignore_errors=True)
    started = time.perf_counter()
    checkpoint.save(buf, root, 1, keep_last=None)
    sync_step = learner.step() + time.perf_counter() - started
    learner.extend_s.clear()
    learner.parts.clear()
    learner.costs.clear()
    during: list[float] = []
    huge_mb = _anon_huge_mb()
    started, cpu = time.perf_counter(), time.thread_time()
    pending = checkpoint.save_in_background(buf, root, 2, keep_last=None)
    call_s, call_cpu_s = time.perf_counter() - started, time.thread_time() - cpu
    during.append(call_s + learner.step())
    writing = [True]  # per step during: the forked writer still running (else: reaped, regrouping)
    while not pending.done():
        during.append(learner.step())
        writing.append(_alive(pending.pid))
    pending.wait()
    write_s = time.perf_counter() - started
    extend_during = max(learner.extend_s)
    worst = learner.parts[int(np.argmax(during))]  # the longest step's extend, sample, update
    worst_cost = learner.costs[int(np.argmax(during))]
    long_cpu = [c[0] for t, c in zip(during, learner.costs, strict=False) if t > TARGET_STALL_S]
    # As many steps again without a checkpoint: the longest step of a window as long as
    # the save's (rare scheduler delays show up in long windows, save or not).
    after = _steps(learner, len(during))
    return {"median_step_s": round(median, 4), "p99_step_s": round(float(np.quantile(baseline, 0.99)), 4),
            "max_baseline_step_s": round(max(baseline), 4),
            "sync_longest_step_s": round(sync_step, 4),
            "anon_huge_mb_at_fork": huge_mb,
            "background_call_s": round(call_s, 4), "background_call_cpu_s": round(call_cpu_s, 4),
            "background_write_s": round(write_s, 3),
            "background_steps_during": len(during),
            "background_longest_step_s": round(max(during), 4),
            "background_stall_over_median_s": round(max(during) - median, 4),
            "sync_stall_over_median_s": round(sync_step - median, 4),
            "longest_extend_during_s": round(extend_during, 4),
            "longest_step_parts_s": {k: round(v, 4) for k, v in zip(("extend", "sample", "update"), worst,
                                                                      strict=True)},
            "longest_step_cpu_s": round(worst_cost[0], 4), "longest_step_faults": worst_cost[1],
            "longest_step_preempted": worst_cost[2],
            "over_50ms_cpu_s_median": round(statistics.median(long_cpu), 4) if long_cpu else None,
            "during_cpu_s_median": round(statistics.median(c[0] for c in learner.costs[:len(during)]), 4),
            "over_50ms_while_writing_or_after": [
                sum(t > TARGET_STALL_S and w for t, w in zip(during, writing, strict=True)),
                sum(t > TARGET_STALL_S and not w for t, w in zip(during, writing, strict=True))],
            "steps_after_writer_exit": writing.count(False),
            "steps_over_50ms": {"baseline": sum(t > TARGET_STALL_S for t in baseline),
                                "during": sum(t > TARGET_STALL_S for t in during),
                                "after_same_count": sum(t > TARGET_STALL_S for t in after)},
            "after_longest_step_s": round(max(after), 4),
            "after_median_step_s": round(statistics.median(after), 4),
            "during_median_step_s": round(statistics.median(during), 4),
            "stall_target_s": TARGET_STALL_S,
            "meets_stall_target": max(during) - median <= TARGET_STALL_S}


def measure_incremental(buf: Any, root: Path, streams: int, step_bytes: int,
                        ingest_frac: float, learner: Learner | None = None) -> dict[str, Any]:
    """Bytes of an incremental checkpoint after ``ingest_frac`` of the capacity came in;
    ``step_bytes``: the bytes a checkpoint holds per step."""
    from shardreplay import checkpoint

    shutil.rmtree(root, ignore_errors=True)
    checkpoint.save(buf, root, 1, incremental=True, keep_last=None)
    full = _written(checkpoint.checkpoint_dir(root, 1))
    learner = learner or Learner(buf, streams, buf.spec["obs"].shape)
    rounds = max(1, int(buf.stream_capacity * ingest_frac) // INGEST_T)
    for _ in range(rounds):
        learner.step()
    ingested = rounds * INGEST_T * streams * step_bytes
    with_time = time.perf_counter()
    checkpoint.save(buf, root, 2, incremental=True, keep_last=None)
    inc_s = time.perf_counter() - with_time
    inc = _written(checkpoint.checkpoint_dir(root, 2))
    return {"full_checkpoint_bytes": full, "incremental_checkpoint_bytes": inc,
            "ingested_bytes": ingested, "ingest_frac": ingest_frac,
            "incremental_over_ingested": round(inc / ingested, 4),
            "incremental_over_full": round(inc / full, 4), "incremental_save_s": round(inc_s, 3),
            "incremental_target": TARGET_INCREMENTAL,
            "meets_incremental_target": inc / ingested <= TARGET_INCREMENTAL}


def _alive(pid: int | None) -> bool:
    """Whether process ``pid`` runs (a zombie, exited and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _anon_huge_mb() -> int | None:
    """This process's anonymous memory on transparent huge pages, MB (None: not Linux)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) >> 10 for line in f if line.startswith("AnonHugePages:"))
    except OSError:
        return None


def _written(directory: Path) -> int:
    """Bytes of the files in a checkpoint directory (what that save wrote)."""
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
