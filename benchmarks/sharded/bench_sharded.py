"""Sharded replay benchmark: learner steps/s per rank over gloo, against one process.

A learner step is one prioritized ``sample(256)`` plus one ``update_priorities`` of
those 256 keys. Every rank holds the same shard (``--capacity`` steps of ``obs``
float32[64], ``action``, ``reward``; windows of 2 steps), so the global buffer grows with
the number of ranks. Measured in one run, each configuration in fresh processes:

* ``single``: one process, a local :class:`shardreplay.ReplayBuffer` (the baseline, run
  before and after the sharded configurations; their mean is the reference);
* ``K`` gloo ranks on this machine (loopback), :class:`ShardedReplayBuffer` in ``exact``
  and ``local`` mode, for each K of ``--ranks``. On one host, exact mode exchanges records
  through shared memory; ``--exact-gloo`` adds ``exactgloo``: exact mode with
  ``shared_memory=False`` (records through gloo's ``all_to_all``).

Each figure is the median over timing blocks; ranks move in lockstep (every step is
collective), the per-rank figure is their mean. A second, shorter pass with every
collective and local phase timed says where a step's time goes. ``cpu_ratios_per_rank``
compare CPU time per step (this process's, gloo's threads included) the same way: other
load on the machine skews wall-clock rates, hardly CPU time. One JSON line is
printed with the figures, the ratios to the single process (targets: exact >= 0.5,
local >= 0.9) and the machine's core count and load average: with more ranks than cores,
ranks share cores, and the per-rank figure cannot exceed about ``cores / K`` of the
single process even with free communication; ``aggregate`` ratios add all ranks' steps.

Usage::

    python benchmarks/sharded/bench_sharded.py                 # full run, about three minutes on 2 cores
    python benchmarks/sharded/bench_sharded.py --quick         # smoke run
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import common

STREAMS = 32
OBS_DIM = 64
BATCH = 256
ALPHA, BETA = 0.6, 0.4
FILL_CHUNK = 250  # steps per stream per extend call
TARGETS = {"exact": 0.5, "local": 0.9}
FULL = {"capacity": 200_000, "blocks": 5, "steps": 100, "warmup": 30, "profile_steps": 100}
QUICK = {"capacity": 16_000, "blocks": 2, "steps": 20, "warmup": 5, "profile_steps": 20}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = common.parser(__doc__, quick="smoke run with small defaults")
    p.add_argument("--ranks", default="2,4", help="comma-separated world sizes (default 2,4)")
    p.add_argument("--prefetch", default="1,32,128,256",
                   help="comma-separated prefetch depths of the sharded buffer (default 1,32,128,256)")
    p.add_argument("--capacity", type=int, help="steps per rank (multiple of 32*250; default 200,000)")
    p.add_argument("--blocks", type=int, help="timing blocks per figure, median reported (default 5)")
    p.add_argument("--steps", type=int, help="learner steps per timing block (default 100)")
    p.add_argument("--warmup", type=int, help="untimed learner steps before timing (default 30)")
    p.add_argument("--profile-steps", type=int, help="steps of the phase-timing pass (default 100)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="limit for each configuration")
    p.add_argument("--exact-gloo", action="store_true",
                   help="also time exact mode with shared_memory=False (records through all_to_all)")
    args = p.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.capacity <= 0 or args.capacity % (STREAMS * FILL_CHUNK):
        p.error(f"--capacity must be a positive multiple of {STREAMS * FILL_CHUNK}")
    args.ranks = [int(k) for k in args.ranks.split(",") if k.strip()]
    args.prefetch = [int(k) for k in args.prefetch.split(",") if k.strip()]
    if any(k < 1 for k in args.prefetch):
        p.error("--prefetch must be positive integers")
    if any(k < 1 for k in args.ranks):
        p.error("--ranks must be positive integers")
    return args


# -- the workload (runs in the children) ----------------------------------------------------------
def make_shard(capacity: int, seed: int) -> Any:
    """A prioritized shard of ``capacity`` steps, filled with random steps and episodes."""
    import shardreplay as sr

    spec = sr.Spec({"obs": sr.Field((OBS_DIM,), np.float32), "action": sr.Field((), np.int64),
                    "reward": sr.Field((), np.float32)})
    per_stream = capacity // STREAMS
    buf = sr.ReplayBuffer(spec, num_streams=STREAMS, stream_capacity=per_stream, window=2,
                          sampler="prioritized", alpha=ALPHA, beta=BETA, seed=seed)
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((STREAMS, FILL_CHUNK, OBS_DIM), dtype=np.float32)
    prev_last = np.ones(STREAMS, bool)  # the first step of every stream is FIRST
    for _ in range(per_stream // FILL_CHUNK):
        done = rng.random((STREAMS, FILL_CHUNK)) < 0.01
        types = np.empty((STREAMS, FILL_CHUNK), np.uint8)
        for t in range(FILL_CHUNK):
            types[:, t] = np.where(prev_last, 0, np.where(done[:, t], 2, 1))
            prev_last = types[:, t] == 2
        buf.extend({"obs": obs, "action": rng.integers(0, 18, (STREAMS, FILL_CHUNK)),
                    "reward": rng.standard_normal((STREAMS, FILL_CHUNK), dtype=np.float32),
                    "step_type": types})
    return buf


def priorities(seed: int) -> list[np.ndarray]:
    """Stand-ins for |TD error|, cycled through by the timed loops."""
    rng = np.random.default_rng(seed)
    return [rng.uniform(1e-3, 2.0, BATCH).astype(np.float32) for _ in range(64)]


CPU_MS_PER_STEP: list[float] = []  # this process's CPU ms per step of each time_blocks call


def time_blocks(step: Callable[[int], None], args: argparse.Namespace,
                sync: Callable[[], None] = lambda: None, multiple: int = 1) -> list[float]:
    """Steps/s of each timing block after the warm-up (``sync`` aligns ranks per block).

    Warm-up and blocks are whole multiples of ``multiple`` steps (the prefetch depth), so
    every block holds the same number of exchanges."""
    warmup, steps = _round_up(args.warmup, multiple), _round_up(args.steps, multiple)
    for i in range(warmup):
        step(i)
    rates, cpu, k = [], [], warmup
    for _ in range(args.blocks):
        sync()
        with common.timed() as block:
            for _ in range(steps):
                step(k)
                k += 1
        rates.append(steps / block.wall_s)
        cpu.append(1e3 * block.cpu_s / steps)
    CPU_MS_PER_STEP.append(common.median(cpu))
    return rates


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class PhaseTimer:
    """Wall time spent in named phases (wrapped callables), in ms per learner step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._wrapped: list[tuple[Any, str, Any]] = []

    def wrap(self, obj: Any, attr: str, name: str | None = None) -> None:
        """Time every call of ``obj.attr`` (a method, or a module's function); collectives
        are named by their ``op`` argument."""
        method = getattr(obj, attr)
        self._wrapped.append((obj, attr, vars(obj).get(attr)))

        def timed(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*a, **kw)
            finally:
                label = name or (a[-1] if a and isinstance(a[-1], str) else attr)
                self.seconds[label] += time.perf_counter() - start

        setattr(obj, attr, timed)  # shadows the class's method, or replaces the module's function

    def unwrap(self) -> None:
        """Remove every wrapper: what was there before is used again."""
        for obj, attr, own in reversed(self._wrapped):
            if own is None:
                delattr(obj, attr)  # the class's method shows through again
            else:
                setattr(obj, attr, own)
        self._wrapped.clear()

    def per_step_ms(self, steps: int, total_s: float) -> dict[str, float]:
        out = {k: round(1e3 * v / steps, 3) for k, v in sorted(self.seconds.items())}
        out["total"] = round(1e3 * total_s / steps, 3)
        out["other"] = round(out["total"] - sum(v for k, v in out.items() if k != "total"), 3)
        return out


def _single(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    buf = make_shard(args.capacity, seed=0)
    prios = priorities(0)

    def step(i: int) -> None:
        b = buf.sample(BATCH)
        buf.update_priorities(b.keys, prios[i % len(prios)])

    rates = time_blocks(step, args)
    timer = PhaseTimer()
    from shardreplay import testing

    for attr in ("draw", "gather"):
        timer.wrap(testing.shard(buf), attr, f"local.{attr}")
    timer.wrap(buf, "update_priorities", "local.update_priorities")
    start = time.perf_counter()
    for i in range(args.profile_steps):
        step(i)
    return {"steps_per_s": common.median(rates, 1),
            "cpu_ms_per_step": round(CPU_MS_PER_STEP[-1], 4),
            "steps_per_s_range": [round(min(rates), 1), round(max(rates), 1)],
            "phases_ms_per_step": timer.per_step_ms(args.profile_steps, time.perf_counter() - start)}


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from shardreplay.distributed import ShardedReplayBuffer
    from shardreplay.distributed.sharded_buffer import internals_of

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        shard = make_shard(args.capacity, seed=rank)
        prios = priorities(rank)
        out: dict[str, Any] = {}
        cases = [("exact", "exact", True), ("local", "local", True)]
        if args.exact_gloo:  # exact mode with the records through gloo's all_to_all
            cases.append(("exactgloo", "exact", False))
        for depth in args.prefetch:
            bufs = {name: ShardedReplayBuffer(shard, timeout_s=args.timeout_s, prefetch=depth,
                                              shared_memory=shm, mode=mode) for name, mode, shm in cases}
            out.setdefault("global_len", len(bufs["exact"]))
            out.setdefault("collective_floor_ms", _floor(internals_of(bufs["exact"]).collectives))
            for name, _mode, _shm in cases:
                buf = bufs[name]

                def step(i: int, buf: Any = buf) -> None:
                    b = buf.sample(BATCH)
                    buf.update_priorities(b.keys, prios[i % len(prios)])

                rates = time_blocks(step, args, sync=dist.barrier, multiple=depth)
                out[f"{name}_p{depth}"] = {
                    "steps_per_s": common.median(rates), "range": [min(rates), max(rates)],
                    "cpu_ms_per_step": CPU_MS_PER_STEP[-1],
                    "phases_ms_per_step": _profile(buf, step, args, dist.barrier, depth)}
                # Use up the prefetched batches and route queued updates: the next
                # configuration starts from a settled shard.
                while buf.prefetched:
                    buf.sample(BATCH)
                buf.flush_updates()
        return out
    finally:
        dist.destroy_process_group()


def _floor(comm: Any, calls: int = 200) -> dict[str, float]:
    """Median ms of the smallest collectives a step issues (the per-collective floor)."""
    small = np.zeros(4, np.float64)
    counts = np.zeros(comm.world_size, np.int64)
    ones = [1] * comm.world_size
    ops = {"all_gather_4xf64": lambda: comm.all_gather(small, "floor"),
           "all_to_all_1xi64": lambda: comm.all_to_all(counts, ones, ones, "floor")}
    out = {}
    for name, op in ops.items():
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            op()
            times.append(time.perf_counter() - start)
        out[name] = round(1e3 * common.median(times[calls // 10:]), 3)
    return out


def _profile(buf: Any, step: Callable[[int], None], args: argparse.Namespace,
             sync: Callable[[], None], depth: int) -> dict[str, float]:
    """Time every collective (by operation) and local phase over ``profile_steps`` steps."""
    from shardreplay import testing
    from shardreplay.distributed import exact_exchange
    from shardreplay.distributed.sharded_buffer import internals_of

    comm, shard = internals_of(buf).collectives, testing.shard(buf)
    timer = PhaseTimer()
    for attr in ("all_gather", "all_to_all", "all_reduce_sum"):
        timer.wrap(comm, attr)
    for attr in ("draw", "gather", "apply_priorities"):
        timer.wrap(shard, attr, f"local.{attr}")
    timer.wrap(exact_exchange, "split_batches", "records.unpack")  # received records as batches
    steps = _round_up(args.profile_steps, depth)
    sync()
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    total = time.perf_counter() - start
    timer.unwrap()
    return timer.per_step_ms(steps, total)


# -- the parent ------------------------------------------------------------------------------------
def _child(kind: str, rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    try:
        result = _single(args) if kind == "single" else _rank(rank, world, port, args)
        out.put((rank, "ok", result))
    except BaseException as exc:  # reported by the parent, which fails the run
        out.put((rank, "error", f"{type(exc).__name__}: {exc}"))


def run_config(kind: str, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run one configuration in fresh spawned processes; every child is joined or killed."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = common.free_port()
    from shardreplay.runtime.actor.processes import stop_processes  # lazily: ranks re-import this module

    procs = [ctx.Process(target=_child, args=(kind, r, world, port, args, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, status, value = out.get(timeout=args.timeout_s)
            if status != "ok":
                raise RuntimeError(f"{kind} rank {rank} of {world} failed: {value}")
            results[rank] = value
    except queue.Empty as exc:
        raise RuntimeError(f"{kind} x{world} did not finish in {args.timeout_s} s") from exc
    finally:
        stop_processes(procs, timeout_s=5.0, grace_s=30)
    return [results[r] for r in range(world)]


def summarize(singles: list[dict[str, Any]], worlds: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Figures per world and mode, and the ratios to the single process (the mean of its
    runs before and after the sharded ones, so that a load drifting during the run
    weighs on both sides alike)."""
    base = statistics.mean(s["steps_per_s"] for s in singles)
    base_cpu = statistics.mean(s["cpu_ms_per_step"] for s in singles)
    report: dict[str, Any] = {"single": {"steps_per_s": round(base, 1),
                                         "cpu_ms_per_step": round(base_cpu, 4), "runs": singles}}
    ratios: dict[str, float] = {}
    cpu_ratios: dict[str, float] = {}  # single's CPU per step over a rank's: robust to other load
    for k, ranks in worlds.items():
        entry: dict[str, Any] = {"global_len": ranks[0]["global_len"],
                                 "collective_floor_ms": ranks[0]["collective_floor_ms"]}
        for case in (c for c in ranks[0] if c.startswith(("exact_", "local_", "exactgloo_"))):
            per_rank = [r[case]["steps_per_s"] for r in ranks]
            rate = statistics.mean(per_rank)
            phases = {name: round(statistics.mean(r[case]["phases_ms_per_step"][name] for r in ranks), 3)
                      for name in ranks[0][case]["phases_ms_per_step"]}
            cpu_ms = statistics.mean(r[case]["cpu_ms_per_step"] for r in ranks)
            entry[case] = {"steps_per_s_per_rank": round(rate, 1), "cpu_ms_per_step": round(cpu_ms, 4),
                           "slowest_rank_steps_per_s": round(min(per_rank), 1),
                           "phases_ms_per_step_mean_over_ranks": phases}
            ratios[f"{case}_{k}ranks_per_rank_vs_single"] = round(rate / base, 3)
            ratios[f"{case}_{k}ranks_aggregate_vs_single"] = round(k * rate / base, 3)
            cpu_ratios[f"{case}_{k}ranks"] = round(base_cpu / cpu_ms, 3)
        report[f"ranks{k}"] = entry
    report["ratios"] = ratios
    report["cpu_ratios_per_rank"] = cpu_ratios
    report["meets_targets_per_rank"] = {
        name: value >= TARGETS[name.split("_")[0].replace("gloo", "")]
        for name, value in ratios.items() if "per_rank" in name}
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every configuration and print the JSON line."""
    args = parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["OMP_NUM_THREADS"] = "1"  # ranks share the cores; no intra-op thread pools
    load_before = common.loadavg()
    start = time.perf_counter()
    singles = [run_config("single", 1, args)[0]]
    worlds = {k: run_config("sharded", k, args) for k in args.ranks}
    singles.append(run_config("single", 1, args)[0])
    result = {
        "benchmark": "bench_sharded", "cpu_cores": common.cpus(),
        "note": (f"{common.cpus()} cores: with K ranks > cores the ranks share cores, so a per-rank "
                 f"figure is bounded by about cores/K of the single process; ranks run gloo on loopback"),
        "capacity_per_rank": args.capacity, "obs": f"float32[{OBS_DIM}]", "batch": BATCH,
        "learner_step": "prioritized sample(256) + update_priorities(256)",
        "blocks": args.blocks, "steps_per_block": args.steps, "targets_per_rank": TARGETS,
        **summarize(singles, worlds),
        "load_avg_before": load_before, "load_avg_after": common.loadavg(),
        "seconds": round(time.perf_counter() - start, 1), "python": common.python(),
    }
    common.emit_line(result, args.out)
    return result


if __name__ == "__main__":
    main()
