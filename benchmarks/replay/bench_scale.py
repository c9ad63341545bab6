"""Replay at scale: per-transition sample and update costs, insert rate and memory per step
at 1M, 10M (and 100M where memory allows) steps in one buffer, beside cpprb; one JSON line.

Each (library, capacity, sampler) case runs in a fresh child process, so its RSS holds only
its own buffer. A case fills its buffer with ``extend`` of 32 streams x 1,000 steps
(shardreplay) or ``add`` of 32,000 transitions (cpprb), then times, in alternating blocks:
``sample(256)`` and, prioritized, the learner step (``sample(256)`` then
``update_priorities`` of those 256). Figures are medians of the blocks with their range;
``*_us_per_transition`` divides a call by 256. ``rss_bytes_per_step``: the RSS the filled
buffer added, per stored step. cpprb stores ``next_obs`` as its own field (its
``next_of`` is not used), as in ``bench_replay.py``.

Usage::

    python benchmarks/replay/bench_scale.py                      # 1M and 10M, obs float32[4]
    python benchmarks/replay/bench_scale.py --sizes 1e6,1e7,1e8 --obs-dim 4
    python benchmarks/replay/bench_scale.py --quick              # 100k, seconds

``--checkpoint DIR`` times instead the checkpoint of one prioritized memory-mapped buffer
per size (files under DIR): a full incremental save, ``--ingest`` of the capacity written,
the next incremental save (seconds, CPU seconds, bytes, and what the bytes are), then an
M -> N restore of it onto ``--restore-shards`` buffers of ``capacity / N`` each (one after
the other in this process). It stops when MemAvailable falls below ``--min-free-gib``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import common
import numpy as np
import replay_workload as W

STREAMS = 32
CHUNK = 1_000  # steps per stream per extend while filling
BATCH = 256
CHILD_TIMEOUT_S = 3_600


def parse_args(argv: list[str] | None = None) -> Any:
    """The command line."""
    p = common.parser(__doc__, quick="smoke run: 100k steps, 3 blocks of 30 calls")
    p.add_argument("--sizes", default="1e6,1e7", help="comma-separated capacities in steps")
    p.add_argument("--obs-dim", type=int, default=4, help="float32 observation size (4 or 64)")
    p.add_argument("--libs", default="shardreplay,cpprb")
    p.add_argument("--modes", default="prioritized,uniform")
    p.add_argument("--blocks", type=int, default=7)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall time, or this thread's CPU time (steadier on a busy machine)")
    p.add_argument("--checkpoint", type=Path, help="time checkpoints of memory-mapped buffers in this folder")
    p.add_argument("--ingest", type=float, default=0.01, help="--checkpoint: capacity written between saves")
    p.add_argument("--restore-shards", type=int, default=2, help="--checkpoint: N of the M -> N restore")
    p.add_argument("--min-free-gib", type=float, default=6.0, help="--checkpoint: stop below it")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.blocks, args.calls = "1e5", 3, 30
    return args


def _pool(obs_dim: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    n = STREAMS * CHUNK
    done = (rng.random((STREAMS, CHUNK)) < W.DONE_PROBABILITY)
    done[:, 0], done[:, -2], done[:, -1] = False, False, True  # every chunk ends its episodes
    return {"obs": rng.standard_normal((n, obs_dim)).astype(np.float32),
            "action": rng.integers(0, 18, n), "reward": rng.standard_normal(n).astype(np.float32),
            "done": done.reshape(-1)}


class _Ours:
    def __init__(self, capacity: int, mode: str, obs_dim: int, **storage: Any) -> None:
        import torch

        import shardreplay as sr

        self.torch = torch
        spec = sr.Spec({"obs": sr.Field((obs_dim,), np.float32), "action": sr.Field((), np.int64),
                        "reward": sr.Field((), np.float32)})
        self.buf = sr.ReplayBuffer(spec, num_streams=STREAMS, stream_capacity=capacity // STREAMS, window=2,
                                   sampler=mode, alpha=W.ALPHA, beta=W.BETA, seed=0, **storage)

    def prepare(self, pool: dict[str, np.ndarray]) -> None:
        done = pool["done"].reshape(STREAMS, CHUNK)
        types = np.where(done, W.LAST, W.MID).astype(np.uint8)
        types[:, 1:][done[:, :-1]] = W.FIRST
        types[:, 0] = W.FIRST
        rows = (STREAMS, CHUNK)
        self.chunk = {"obs": pool["obs"].reshape(*rows, -1), "action": pool["action"].reshape(rows),
                      "reward": pool["reward"].reshape(rows),
                      "discount": np.where(done, 0.0, 1.0).astype(np.float32).reshape(rows)}
        self.types = types
        self.prios = [self.torch.from_numpy(p) for p in W.random_priorities()]

    def insert(self) -> int:
        self.buf.extend({**self.chunk, "step_type": self.types})
        return STREAMS * CHUNK

    def sample(self) -> Any:
        return self.buf.sample(BATCH)

    def learner_step(self, i: int) -> None:
        batch = self.buf.sample(BATCH)
        self.buf.update_priorities(batch.keys, self.prios[i % len(self.prios)])


class _Cpprb:
    def __init__(self, capacity: int, mode: str, obs_dim: int) -> None:
        import cpprb

        env = {"obs": {"shape": obs_dim, "dtype": np.float32}, "action": {"dtype": np.int64},
               "reward": {"dtype": np.float32}, "done": {"dtype": np.bool_},
               "next_obs": {"shape": obs_dim, "dtype": np.float32}}
        self.prioritized = mode == "prioritized"
        self.buf = (cpprb.PrioritizedReplayBuffer(capacity, env, alpha=W.ALPHA) if self.prioritized
                    else cpprb.ReplayBuffer(capacity, env))

    def prepare(self, pool: dict[str, np.ndarray]) -> None:
        self.chunk = {**pool, "next_obs": np.roll(pool["obs"], -1, axis=0)}
        self.prios = W.random_priorities()

    def insert(self) -> int:
        self.buf.add(**self.chunk)
        return STREAMS * CHUNK

    def sample(self) -> Any:
        return self.buf.sample(BATCH, beta=W.BETA) if self.prioritized else self.buf.sample(BATCH)

    def learner_step(self, i: int) -> None:
        got = self.buf.sample(BATCH, beta=W.BETA)
        self.buf.update_priorities(got["indexes"], self.prios[i % len(self.prios)])


def _blocks(fn: Any, blocks: int, calls: int, clock: str) -> list[float]:
    now = W.CLOCKS[clock]
    for i in range(min(50, calls)):
        fn(i)
    out = []
    for _ in range(blocks):
        t0 = now()
        for i in range(calls):
            fn(i)
        out.append((now() - t0) / calls * 1e6)
    return out


def _figure(out: dict[str, Any], name: str, us: list[float]) -> None:
    mid = common.median(us)
    out[f"{name}_us"] = round(mid, 1)
    out[f"{name}_us_range"] = [round(min(us), 1), round(max(us), 1)]
    out[f"{name}_per_s"] = round(1e6 / mid, 1)
    out[f"{name}_us_per_transition"] = round(mid / BATCH, 3)


def run_child(lib: str, capacity: int, mode: str, args: Any) -> dict[str, Any]:
    """Build, fill and time one case in this process."""
    rng = np.random.default_rng(0)
    pool = _pool(args.obs_dim, rng)
    kind = _Ours if lib == "shardreplay" else _Cpprb
    # Imports, compiled code and first-call set-up out of the figures: a small buffer first.
    warm = kind(2 * STREAMS * CHUNK, mode, args.obs_dim)
    warm.prepare(pool)
    for i in range(3):
        warm.insert()
        warm.sample()
        if mode == "prioritized":
            warm.learner_step(i)
    del warm
    gc.collect()
    base = W.rss_mib()
    case = kind(capacity, mode, args.obs_dim)
    case.prepare(pool)
    out: dict[str, Any] = {"rss_mib_after_create": round(W.rss_mib() - base, 1)}
    stored, t0 = 0, time.perf_counter()
    while stored < capacity:
        stored += case.insert()
    out["insert_steps_per_s"] = round(stored / (time.perf_counter() - t0))
    out["rss_mib_buffer"] = round(W.rss_mib() - base, 1)
    out["rss_bytes_per_step"] = round(out["rss_mib_buffer"] * 2**20 / capacity, 1)
    _figure(out, "sample", _blocks(lambda i: case.sample(), args.blocks, args.calls, args.clock))
    if mode == "prioritized":
        _figure(out, "learner_step", _blocks(case.learner_step, args.blocks, args.calls, args.clock))
    out["rss_mib_peak"] = W.peak_rss_mib()
    return out


def _available_gib(floor: float) -> float:
    """MemAvailable in GiB; raises MemoryError below ``floor`` (the machine is shared)."""
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    if kib / 2**20 < floor:
        raise MemoryError(f"MemAvailable {kib / 2**20:.1f} GiB < {floor} GiB: stopped")
    return round(kib / 2**20, 1)


def _stop_below(floor: float, root: Path) -> None:
    """Exit the process (its files removed) as soon as MemAvailable falls below ``floor``,
    also in the middle of a save or restore."""
    import shutil

    while True:
        try:
            _available_gib(floor)
        except MemoryError as exc:
            print(json.dumps({"error": str(exc)}), flush=True)
            shutil.rmtree(root, ignore_errors=True)
            os._exit(3)
        time.sleep(0.5)


def _timed(out: dict[str, Any], name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn(*args, **kwargs)
    out[f"{name}_s"] = round(time.perf_counter() - wall, 2)
    out[f"{name}_cpu_s"] = round(time.process_time() - cpu, 2)
    return result


def run_checkpoint(capacity: int, args: Any) -> dict[str, Any]:
    """Save a memory-mapped prioritized buffer of ``capacity`` steps incrementally twice and
    restore the second checkpoint onto ``--restore-shards`` buffers (see the module)."""
    import shutil

    from shardreplay import checkpoint
    from shardreplay.checkpoint.loading import load_shard

    root = args.checkpoint / str(capacity)
    shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {"mem_available_gib_start": _available_gib(args.min_free_gib)}
    threading.Thread(target=_stop_below, args=(args.min_free_gib, root), daemon=True).start()

    def buffer(cap: int, name: str) -> _Ours:
        case = _Ours(cap, "prioritized", args.obs_dim, storage="memmap", directory=root / name)
        case.prepare(_pool(args.obs_dim, np.random.default_rng(0)))
        return case

    case, stored = buffer(capacity, "source"), 0
    while stored < capacity:
        stored += case.insert()
        if stored % (100 * STREAMS * CHUNK) == 0:
            _available_gib(args.min_free_gib)
    for i in range(200):
        case.learner_step(i)
    ckpts = root / "checkpoints"
    _timed(out, "save_full", checkpoint.save, case.buf, ckpts, 1, incremental=True, keep_last=None)
    out["full_bytes"] = sum(f.stat().st_size for f in checkpoint.checkpoint_dir(ckpts, 1).iterdir())
    ingested = 0
    while ingested < args.ingest * capacity:
        ingested += case.insert()
    for i in range(200):
        case.learner_step(i)
    out["mem_available_gib_before_save"] = _available_gib(args.min_free_gib)
    _timed(out, "save_incremental", checkpoint.save, case.buf, ckpts, 2, incremental=True, keep_last=None)
    out["ingested_steps"] = ingested
    out["ingested_field_bytes"] = ingested * (4 * args.obs_dim + 8 + 4)
    out["incremental_bytes"] = sum(f.stat().st_size for f in checkpoint.checkpoint_dir(ckpts, 2).iterdir())
    out["incremental_bytes_per_stored_step"] = round(out["incremental_bytes"] / capacity, 2)
    del case
    gc.collect()
    n = args.restore_shards
    for k in range(n):
        out[f"mem_available_gib_before_restore_{k}"] = _available_gib(args.min_free_gib)
        target = buffer(capacity // n, f"restore-{k}")
        report = _timed(out, f"restore_1_to_{n}_shard_{k}", load_shard, checkpoint.checkpoint_dir(ckpts, 2),
                        target.buf, k, n)
        out[f"restore_1_to_{n}_shard_{k}_steps"] = report.steps
        out[f"restore_1_to_{n}_shard_{k}_dropped_steps"] = report.dropped_steps
        del target
        gc.collect()
    out["rss_mib_peak"] = W.peak_rss_mib()
    shutil.rmtree(root, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    """Run every case in its own child; print one JSON line."""
    args = parse_args(argv)
    if args.checkpoint:
        sizes = [int(float(s)) // STREAMS // CHUNK * STREAMS * CHUNK for s in args.sizes.split(",")]
        line = {"benchmark": "replay_scale_checkpoint", "started": common.now(), "commit": common.commit(),
                "cpus": common.cpus(), "loadavg_start": common.loadavg(), "obs_dim": args.obs_dim,
                "ingest": args.ingest, "results": {}}
        for capacity in sizes:
            print(f"bench_scale: checkpoint {capacity:,}", file=sys.stderr, flush=True)
            try:
                line["results"][str(capacity)] = run_checkpoint(capacity, args)
            except MemoryError as exc:
                line["results"][str(capacity)] = {"error": str(exc)}
        line["loadavg_end"] = common.loadavg()
        common.emit_line(line, args.out)
        return
    if args.child:
        lib, capacity, mode = args.child.split(":")
        try:
            result = run_child(lib, int(capacity), mode, args)
        except ImportError as exc:
            result = {"missing": str(exc)}
        except MemoryError as exc:
            result = {"error": f"MemoryError: {exc}"}
        print(json.dumps(result), flush=True)
        return
    sizes = [int(float(s)) // STREAMS // CHUNK * STREAMS * CHUNK for s in args.sizes.split(",")]
    line: dict[str, Any] = {"benchmark": "replay_scale", "started": common.now(), "commit": common.commit(),
                            "cpus": common.cpus(), "loadavg_start": common.loadavg(), "obs_dim": args.obs_dim,
                            "clock": args.clock,
                            "results": {}}
    for capacity in sizes:
        for mode in args.modes.split(","):
            for lib in args.libs.split(","):
                print(f"bench_scale: {lib} {mode} {capacity:,}", file=sys.stderr, flush=True)
                cmd = [sys.executable, __file__, "--child", f"{lib}:{capacity}:{mode}", "--obs-dim",
                       str(args.obs_dim), "--blocks", str(args.blocks), "--calls", str(args.calls),
                       "--clock", args.clock]
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=CHILD_TIMEOUT_S,
                                      check=False)
                lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
                result = json.loads(lines[-1]) if lines else {"error": f"child exited {proc.returncode}"}
                line["results"].setdefault(str(capacity), {}).setdefault(mode, {})[lib] = result
                gc.collect()
            both = line["results"][str(capacity)][mode]
            for figure in ("learner_step", "sample"):
                ours, theirs = both.get("shardreplay", {}), both.get("cpprb", {})
                if f"{figure}_us" in ours and f"{figure}_us" in theirs:
                    both[f"{figure}_vs_cpprb"] = round(theirs[f"{figure}_us"] / ours[f"{figure}_us"], 2)
    line["loadavg_end"] = common.loadavg()
    common.emit_line(line, args.out)


if __name__ == "__main__":
    main()
