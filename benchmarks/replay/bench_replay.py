"""Replay benchmark: shardreplay, TorchRL, cpprb (and SB3, one env) side by side, one JSON line.

Each (library, mode) case runs in a fresh child process of this interpreter, so its memory
figures hold only its own buffer; a peer that cannot be imported is reported as missing.
``single_env`` runs its libraries in one child, their timing blocks alternated, and its
ratio to SB3 is the median of the block-against-block ratios. Sampling speed is compared the
same way: a ``paired`` child per round holds shardreplay's uniform and prioritized buffers
and cpprb's uniform one, filled alike, and times their ``sample(256)`` blocks in turn;
``uniform_sample_vs_cpprb`` and ``uniform_sample_vs_prioritized`` are the medians of those
paired ratios; another holds both libraries' prioritized buffers and times their learner
steps in turn (``prioritized_learner_step_vs_cpprb``). Each case's own child still gives
its rates and memory. Insert rates time
the buffer's creation with its fill, for every library.
The parent prints one JSON line with every figure and the ratios of shardreplay to the
peers (higher is better for rates; for ``rss_vs_cpprb`` lower is better). The workload is
described in ``replay_workload.py``; the calls made per library in ``replay_cases.py``.

Before anything is measured, each child exercises its library once on a tiny buffer
(``warm_up``), for every library alike, so compiled code and first-call set-up are neither
timed nor counted as buffer memory; ``warmup_seconds`` and ``rss_mib_code`` report that
one-time cost, and ``rss_mib_buffer_and_code`` adds it back. Differences from the harness
that first measured the peers on the reference workload (``replay_workload.py``): that
warm-up (that harness has none), and
``rss_mib_after_first_add`` (numpy maps large arrays with transparent huge pages, so the
first write into each stream row faults a 2 MiB page in each array).

Usage::

    python benchmarks/replay/bench_replay.py                 # full run, a few minutes on 2 cores
    python benchmarks/replay/bench_replay.py --quick         # smoke run, seconds
    python benchmarks/replay/bench_replay.py --libs shardreplay,cpprb --mode prioritized
    python benchmarks/replay/bench_replay.py --mode single_env  # one env, 1 step per add (vs SB3)
    python benchmarks/replay/bench_replay.py --workload atari  # Nature-DQN frames (replay_frames.py)
    python benchmarks/replay/bench_replay.py --workload atari --interleave  # learner steps, A/B blocks
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import common
import replay_frames as F
import replay_workload as W

LIBRARIES = ("shardreplay", "torchrl", "cpprb", "sb3")
MODES = ("uniform", "prioritized")
SINGLE_ENV = "single_env"  # one env, one step per add: replay_single_env.py (peer: sb3)
# single_env with sb3 selected also runs replay_fill_sweep.py (every fill and field kind,
# both libraries interleaved in one child): the line's "fill_sweep" entry.
FILL_SWEEP = "fill_sweep"
# Child: timing blocks of several buffers in turn. Per mode: the buffers (key -> library,
# mode; the first is the numerator of every ratio), the call timed and its figure.
PAIRED = "paired"
PAIRED_CASES = {
    "uniform": ({"uniform": ("shardreplay", "uniform"), "prioritized": ("shardreplay", "prioritized"),
                 "cpprb": ("cpprb", "uniform")}, "sample", "sample_batches_per_s"),
    "prioritized": ({"shardreplay": ("shardreplay", "prioritized"), "cpprb": ("cpprb", "prioritized")},
                    "learner_step", "learner_steps_per_s"),
}
MODE_LIBRARIES = {"uniform": LIBRARIES[:3], "prioritized": LIBRARIES[:3], SINGLE_ENV: ("shardreplay", "sb3")}
CHILD_TIMEOUT_S = 1200
FULL = {"n_insert": W.CAPACITY, "blocks": 7, "calls": 200, "warmup": 50}
WARMUP_CAPACITY = 3_200
# shardreplay builds its one-step add path after 1,000 adds (buffer/shard.py ONE_STEP_AFTER);
# warming up past it keeps that first build (kernels loaded or compiled) out of the timed fill.
WARMUP_ADDS = 1_100
QUICK = {"n_insert": 64_000, "blocks": 3, "calls": 50, "warmup": 5}

# (name, numerator (library, mode, figure), denominator, target, higher_is_better)
RATIOS = (
    ("prioritized_learner_step_vs_torchrl", "prioritized", "learner_steps_per_s", "torchrl", 2.0, True),
    ("prioritized_learner_step_vs_cpprb", "prioritized", "learner_steps_per_s", "cpprb", 2.0, True),
    ("uniform_sample_vs_cpprb", "uniform", "sample_batches_per_s", "cpprb", 1.0, True),
    ("uniform_sample_vs_torchrl", "uniform", "sample_batches_per_s", "torchrl", None, True),
    # Paired blocks only (the paired child): shardreplay's two samplers on the same data.
    ("uniform_sample_vs_prioritized", "uniform", "sample_batches_per_s", "prioritized", 1.0, True),
    ("prioritized_sample_vs_cpprb", "prioritized", "sample_batches_per_s", "cpprb", None, True),
    ("prioritized_update_vs_cpprb", "prioritized", "update_calls_per_s", "cpprb", None, True),
    ("uniform_insert_vs_cpprb", "uniform", "insert_tps", "cpprb", None, True),
    ("prioritized_insert_vs_cpprb", "prioritized", "insert_tps", "cpprb", None, True),
    ("uniform_overwrite_vs_cpprb", "uniform", "overwrite_tps", "cpprb", None, True),
    ("prioritized_overwrite_vs_cpprb", "prioritized", "overwrite_tps", "cpprb", None, True),
    ("uniform_rss_vs_cpprb", "uniform", "rss_mib_buffer", "cpprb", None, False),
    ("prioritized_rss_vs_cpprb", "prioritized", "rss_mib_buffer", "cpprb", None, False),
    ("prioritized_rss_with_code_vs_cpprb", "prioritized", "rss_mib_buffer_and_code", "cpprb", None, False),
    ("single_env_add_vs_sb3", SINGLE_ENV, "add_calls_per_s", "sb3", 1.0, True),
    ("single_env_sample_vs_sb3", SINGLE_ENV, "sample_calls_per_s", "sb3", 1.0, True),
)
# Summary ratios over both modes: the worse of the two.
SUMMARY = (("insert_vs_cpprb", ("uniform_insert_vs_cpprb", "prioritized_insert_vs_cpprb"), 1.0, True),
           ("rss_vs_cpprb", ("uniform_rss_vs_cpprb", "prioritized_rss_vs_cpprb"), 0.6, False))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (options as the peer benchmarks')."""
    p = common.parser(__doc__, quick="smoke run: defaults --n-insert 64000 --blocks 3 --calls 50 --warmup 5",
                      reps=1, reps_flag="--repeat",
                      reps_help="rounds of all cases; each figure is the median over rounds (noisy machines)")
    p.add_argument("--workload", choices=["mlp", "atari"], default="mlp",
                   help="mlp: 64-float observations (default); atari: 4x84x84 uint8 frame stacks")
    p.add_argument("--atari-capacity", type=int,
                   help=f"transitions each atari case is filled with (default {F.CAPACITY:,})")
    p.add_argument("--interleave", action="store_true",
                   help="atari: time shardreplay's and cpprb_stack's learner steps in alternating "
                        "blocks in one process (robust to a changing load) instead of the cases")
    p.add_argument("--libs", help="comma-separated subset of " + ",".join(LIBRARIES)
                   + " (atari: of " + ",".join(F.CASE_NAMES) + ")")
    p.add_argument("--mode", choices=[*MODES, SINGLE_ENV, "both", "all"], default="all",
                   help="both: uniform and prioritized; all: both and single_env")
    p.add_argument("--n-insert", type=int, help="transitions to insert (multiple of 32; default 1,000,000)")
    p.add_argument("--blocks", type=int, help="timing blocks per figure, median reported (default 7)")
    p.add_argument("--calls", type=int, help="calls per timing block (default 200)")
    p.add_argument("--warmup", type=int, help="untimed calls before each figure (default 50)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall time (as the peer benchmarks) or this thread's CPU time (steadier on a "
                        "busy machine; leaves out helper threads, which favours TorchRL)")
    p.add_argument("--child", choices=sorted({*LIBRARIES, *F.CASE_NAMES, FILL_SWEEP, SINGLE_ENV, PAIRED}),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for name, value in defaults.items():  # options given explicitly win over --quick
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if args.n_insert % W.ADD_BATCH or args.n_insert <= 0:
        p.error("--n-insert must be a positive multiple of 32")
    if args.atari_capacity is None:
        args.atari_capacity = 6_400 if args.quick else F.CAPACITY
    if args.atari_capacity % F.STREAMS or args.atari_capacity < F.WARMUP_CAPACITY:
        p.error(f"--atari-capacity must be a multiple of {F.STREAMS} and at least {F.WARMUP_CAPACITY}")
    known = F.CASE_NAMES if args.workload == "atari" else LIBRARIES
    args.libs = [name.strip() for name in (args.libs or ",".join(known)).split(",") if name.strip()]
    unknown = sorted(set(args.libs) - set(known))
    if unknown:
        p.error(f"unknown libraries {unknown}; choose from {', '.join(known)}")
    return args


# --------------------------------------------------------------------------- child side
def run_case(library: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build, fill and time one library's buffer in this process; the figures as a dict."""
    from replay_cases import CASES

    case = CASES[library]()
    out: dict[str, Any] = {**case.versions()}
    case.prepare(W.make_pool(args.seed), args.seed)
    before = W.rss_mib()
    with common.timed() as warm:
        warm_up(case, mode)
    out["warmup_seconds"] = round(warm.wall_s, 3)
    # The baseline holds imports, data in native format and the library's loaded code
    # (shardreplay's compiled kernels, ~50 MiB of numba/LLVM); rss_mib_code shows that part.
    out["rss_mib_baseline"] = W.rss_mib()
    out["rss_mib_code"] = round(out["rss_mib_baseline"] - before, 1)
    first_add: list[float] = []

    def add(i: int) -> None:
        if i == 0:
            # Creation is timed with the fill: a library that touches its storage when it
            # creates it (cpprb) and one whose pages fault in at the first writes (numpy's
            # zeroed arrays) then pay for the same work.
            case.create(mode)
            out["rss_mib_after_create"] = W.rss_mib()
        case.add(i)
        if i == 0:  # what the first call loads (compiled code, lazy imports) besides data
            first_add.append(W.rss_mib())

    out.update(W.time_inserts(add, args.n_insert // W.ADD_BATCH))  # created, then filled
    out["rss_mib_after_first_add"] = first_add[0]
    out.update(case.stored())
    out["rss_mib_after_fill"] = W.rss_mib()
    out["rss_mib_buffer"] = round(out["rss_mib_after_fill"] - out["rss_mib_baseline"], 1)
    out["rss_mib_buffer_and_code"] = round(out["rss_mib_buffer"] + out["rss_mib_code"], 1)
    calls = args.n_insert // W.ADD_BATCH
    if args.n_insert >= W.CAPACITY:
        # A full buffer's steady state: every insert overwrites, and no page is touched for
        # the first time (the fill above pays that where a library allocates lazily; cpprb
        # touches its whole storage at creation).
        again = W.time_inserts(lambda i: case.add(calls + i), calls)
        out["overwrite_tps"] = again["insert_tps"]
        out["overwrite_tps_median_chunk"] = again["insert_tps_median_chunk"]
        out["overwrite_tps_best_chunk"] = again["insert_tps_best_chunk"]
    timing = {"calls": args.calls, "blocks": args.blocks, "warmup": args.warmup}
    W.put_rate(out, "sample_batches_per_s", W.time_calls(lambda i: case.sample(), **timing),
               W.SAMPLE_BATCH, "sample_transitions_per_s")
    if mode == "prioritized":
        indices = [case.sample_for_update() for _ in range(W.PRIORITY_SETS)]
        W.put_rate(out, "update_calls_per_s",
                   W.time_calls(lambda i: case.update(indices[i % len(indices)], i), **timing),
                   W.UPDATE_BATCH, "update_items_per_s")
        W.put_rate(out, "learner_steps_per_s", W.time_calls(case.learner_step, **timing))
    out["rss_mib_peak"] = W.peak_rss_mib()
    return out


def warm_up(case: Any, mode: str) -> None:
    """Exercise every timed call once on a tiny buffer, then drop it.

    Compiled code (shardreplay's numba kernels: compiled or loaded from the on-disk
    cache), lazy imports and first-call set-up are then neither timed nor counted as
    buffer memory, for every library alike.
    """
    case.create(mode, capacity=WARMUP_CAPACITY)
    for i in range(max(WARMUP_CAPACITY // W.ADD_BATCH, WARMUP_ADDS)):
        case.add(i)
    case.sample()
    if mode == "prioritized":
        case.update(case.sample_for_update(), 0)
        case.learner_step(0)
    case.buf = None
    gc.collect()


def run_paired(args: argparse.Namespace) -> dict[str, Any]:
    """Fill the buffers of ``PAIRED_CASES[args.mode]`` (those of ``args.libs``) with the same
    transitions, then time their call (uniform: ``sample(256)``; prioritized: a learner
    step) in ``args.blocks`` rounds of one block per buffer, the order turning each round,
    so that a change of load lands on all. Returns ``<figure>_vs_<other>``: the median over
    rounds of the first buffer's block rate over the other's, with its range."""
    from replay_cases import CASES

    wanted, call, figure = PAIRED_CASES[args.mode]
    pool = W.make_pool(args.seed)
    cases = {}
    for key, (library, mode) in wanted.items():
        if library in args.libs:
            case = CASES[library]()
            case.prepare(pool, args.seed)
            warm_up(case, mode)
            case.create(mode)
            for i in range(args.n_insert // W.ADD_BATCH):
                case.add(i)
            cases[key] = case
    rates: dict[str, list[float]] = {key: [] for key in cases}
    for r in range(args.blocks):
        keys = list(cases)
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            timed = getattr(cases[key], call)
            once = (lambda i, f=timed: f(i)) if call == "learner_step" else (lambda i, f=timed: f())
            rates[key].append(W.time_calls(once, calls=args.calls, blocks=1,
                                           warmup=args.warmup if r == 0 else 0)[0])
    first, *others = wanted
    out: dict[str, Any] = {}
    for other in others:
        if first in rates and other in rates:
            ratio = np.asarray(rates[first]) / np.asarray(rates[other])
            name = f"{figure}_vs_{other}"
            out[name] = round(float(np.median(ratio)), 3)
            out[name + "_range"] = [round(float(ratio.min()), 3), round(float(ratio.max()), 3)]
    return out


def child_main(args: argparse.Namespace) -> None:
    """Run one case and print its figures (or why it could not run) as one JSON line."""
    import replay_single_env
    from replay_cases import MissingLibrary

    W.set_clock(args.clock)
    if args.child == FILL_SWEEP:
        import replay_fill_sweep

        try:
            result = replay_fill_sweep.run(quick=args.quick, clock=args.clock)
        except ImportError as exc:
            result = {"missing": str(exc)}
        print(json.dumps(result), flush=True)
        return
    try:
        if args.workload == "atari":
            result: dict[str, Any] = F.run_frames_case(args.child, args)
        elif args.child == PAIRED:
            result = run_paired(args)
        elif args.child == SINGLE_ENV:
            result = replay_single_env.run(
                args.libs, args.n_insert, calls=args.calls, blocks=args.blocks, warmup=args.warmup,
                seed=args.seed)
        else:
            result = run_case(args.child, args.mode, args)
    except MissingLibrary as exc:
        result = {"missing": str(exc)}
    print(json.dumps(result), flush=True)


# -------------------------------------------------------------------------- parent side
def spawn_case(library: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one case in a fresh child process; its figures, or an ``error`` entry."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", library, "--mode", mode,
           "--libs", ",".join(args.libs),
           "--n-insert", str(args.n_insert), "--blocks", str(args.blocks), "--calls", str(args.calls),
           "--warmup", str(args.warmup), "--seed", str(args.seed), "--clock", args.clock,
           "--workload", args.workload, "--atari-capacity", str(args.atari_capacity)] + (
               ["--quick"] if args.quick else [])
    env = {**os.environ, "RL_LOGGING_LEVEL": "WARNING"}  # keep TorchRL's banner off stdout
    print(f"bench_replay: {library} {mode} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env,
                              timeout=CHILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:  # subprocess.run has killed and reaped the child
        return {"error": f"child ran past {CHILD_TIMEOUT_S} s and was killed"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"child exited with status {proc.returncode} (its stderr is above)"}
    result = json.loads(lines[-1])
    result["case_seconds"] = round(time.perf_counter() - start, 1)
    return result


def merge_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from repeated runs of a case: the median of each number, the widest range.

    A case that failed or was missing in any run is reported as its first such run.
    """
    bad = [r for r in runs if "error" in r or "missing" in r]
    if bad or len(runs) == 1:
        return bad[0] if bad else runs[0]
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        values = [r.get(key) for r in runs]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            out[key] = common.median(values, 3 if "_vs_" in key else 1)  # ratios: 3 places
            out[key + "_runs"] = values
        elif key.endswith("_range") and all(isinstance(v, list) for v in values):
            out[key] = [min(v[0] for v in values), max(v[1] for v in values)]
        else:
            out[key] = first
    out["repeats"] = len(runs)
    return out


def ratios(results: dict[str, dict[str, dict[str, Any]]], *, best: bool = False
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """shardreplay's figures over the peers'; and, per target, whether it is met.

    With ``best``, rates are those of the fastest timing block (insert: fastest chunk):
    the figures least disturbed by other work on a shared machine.
    """
    values: dict[str, float | None] = {}
    targets: dict[str, Any] = {}
    for name, mode, figure, peer, target, higher in RATIOS:
        mine = results.get("shardreplay", {}).get(mode, {})
        ours = _figure(mine, figure, best)
        theirs = _figure(results.get(peer, {}).get(mode, {}), figure, best)
        values[name] = round(ours / theirs, 3) if ours and theirs else None
        if f"{figure}_vs_{peer}" in mine:  # measured block against block, alternated in one child
            values[name] = mine[f"{figure}_vs_{peer}"]
        if target is not None:
            targets[name] = _target(values[name], target, higher)
    for name, parts, target, higher in SUMMARY:
        got = [values[p] for p in parts if values[p] is not None]
        values[name] = (min(got) if higher else max(got)) if len(got) == len(parts) else None
        targets[name] = _target(values[name], target, higher)
    return values, targets


def _figure(result: dict[str, Any], figure: str, best: bool) -> float | None:
    if best and figure in ("insert_tps", "overwrite_tps"):
        return result.get(figure + "_best_chunk")
    if best and figure + "_range" in result:
        return result[figure + "_range"][1]
    return result.get(figure)


def _target(value: float | None, target: float, higher: bool) -> dict[str, Any]:
    met = None if value is None else (value >= target if higher else value <= target)
    return {"target": (">= " if higher else "<= ") + str(target), "met": met}


def frames_parent_main(args: argparse.Namespace) -> dict[str, Any]:
    """The atari workload: every case in its own child; figures, ratios and targets."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.repeat):
        for lib in args.libs:
            runs.setdefault(lib, []).append(spawn_case(lib, "prioritized", args))
    results = {lib: merge_runs(got) for lib, got in runs.items()}
    values, targets = F.frames_ratios(results)
    workload = {"frame_stack": F.STACK, "frame": list(F.FRAME), "streams": F.STREAMS,
                "sample_batch": F.SAMPLE_BATCH, "nominal_capacity": F.NOMINAL,
                "capacity": args.atari_capacity, "plain_capacity": min(F.PLAIN_CAPACITY, args.atari_capacity),
                "blocks": args.blocks, "calls_per_block": args.calls, "warmup": args.warmup,
                "seed": args.seed, "repeat": args.repeat, "clock": args.clock}
    return {"workload": workload, "results": results, "ratios": values, "targets": targets}


def parent_main(args: argparse.Namespace) -> None:
    """Run every selected case in its own child and print the merged JSON line."""
    if args.workload == "atari":
        started = common.now()
        load_start = common.loadavg()
        if args.interleave:
            W.set_clock(args.clock)
            body = {"interleaved": F.interleaved_learner_steps(args), "clock": args.clock}
        else:
            body = frames_parent_main(args)
        finished = common.now()
        line = {"benchmark": "replay_atari", "started": started, "finished": finished,
                "python": common.python(), "numpy": np.__version__, "cpus": common.cpus(),
                "loadavg_start": load_start, "loadavg_end": common.loadavg(), **body}
        common.emit_line(line, args.out)
        return

    modes = {"both": MODES, "all": (*MODES, SINGLE_ENV)}.get(args.mode, (args.mode,))
    started = common.now()
    load_start = common.loadavg()  # other work on the machine skews rates
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(args.repeat):  # rounds interleave the libraries, so noise hits them alike
        for mode in modes:
            libs = [lib for lib in args.libs if lib in MODE_LIBRARIES[mode]]
            if mode == SINGLE_ENV and libs:  # one child, the libraries' timing blocks alternated
                both = spawn_case(SINGLE_ENV, mode, argparse.Namespace(**{**vars(args), "libs": libs}))
                for lib in libs:
                    runs.setdefault((lib, mode), []).append(both.get(lib, both))
                continue
            for lib in libs:
                runs.setdefault((lib, mode), []).append(spawn_case(lib, mode, args))
            if "shardreplay" in libs and (mode == "uniform" or "cpprb" in libs):  # the paired blocks
                paired = spawn_case(PAIRED, mode, args)
                ours = runs[("shardreplay", mode)][-1]
                ours.update({"paired": paired} if "error" in paired or "missing" in paired else paired)
    results: dict[str, dict[str, Any]] = {lib: {} for lib, _mode in runs}
    for (lib, mode), got in runs.items():
        results[lib][mode] = merge_runs(got)
    values, targets = ratios(results)
    best_values, best_targets = ratios(results, best=True)
    sweep = (spawn_case(FILL_SWEEP, SINGLE_ENV, args)
             if SINGLE_ENV in modes and "sb3" in args.libs and "shardreplay" in args.libs else None)
    line = {
        "benchmark": "replay",
        "started": started,
        "finished": common.now(),
        "python": common.python(),
        "numpy": np.__version__,
        "cpus": common.cpus(),
        "machine": platform.machine(),
        "loadavg_start": load_start,
        "loadavg_end": common.loadavg(),
        "workload": {"capacity": W.CAPACITY, "obs_dim": W.OBS_DIM, "add_batch": W.ADD_BATCH,
                     "sample_batch": W.SAMPLE_BATCH, "alpha": W.ALPHA, "beta": W.BETA,
                     "n_insert": args.n_insert, "blocks": args.blocks, "calls_per_block": args.calls,
                     "warmup": args.warmup, "seed": args.seed,
                     "repeat": args.repeat, "clock": args.clock},
        "results": results,
        "ratios": values,
        "targets": targets,
        "ratios_best_block": best_values,
        "targets_best_block": best_targets,
    }
    if sweep is not None:
        line["fill_sweep"] = sweep
    common.emit_line(line, args.out)


def main(argv: list[str] | None = None) -> None:
    """Entry point: the parent orchestrates, a ``--child`` runs one case."""
    args = parse_args(argv)
    if args.child:
        child_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
