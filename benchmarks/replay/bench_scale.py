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
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
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
    def __init__(self, capacity: int, mode: str, obs_dim: int) -> None:
        import torch

        import shardreplay as sr

        self.torch = torch
        spec = sr.Spec({"obs": sr.Field((obs_dim,), np.float32), "action": sr.Field((), np.int64),
                        "reward": sr.Field((), np.float32)})
        self.buf = sr.ReplayBuffer(spec, num_streams=STREAMS, stream_capacity=capacity // STREAMS, window=2,
                                   sampler=mode, alpha=W.ALPHA, beta=W.BETA, seed=0)

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


def main(argv: list[str] | None = None) -> None:
    """Run every case in its own child; print one JSON line."""
    args = parse_args(argv)
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
