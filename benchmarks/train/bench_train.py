"""Training throughput: env steps/s and learner updates/s, 1 vs 2 learners, exact vs local.

Each case is one real ``shardreplay train`` run (CartPole-v1, 2 actors x 4 envs, the
training defaults otherwise) with a fixed step budget. Figures come from the run's own
records:

- ``steady``: from ``metrics.csv`` (one row a second), the change in env steps and
  updates between the first row with updates and the last row, over the wall time
  between them (start-up, imports and the replay warm-up are left out);
- ``overall``: ``summary.json``'s env steps and updates over its wall time (the loop
  from the first policy to the end, warm-up included).

``samples_per_s`` = updates/s x batch x learners (windows sampled per second, all
ranks). The samples-per-insert limiter ties env steps to updates: env steps/s is what
the learners can consume, not what the actors could produce. On a machine with fewer
cores than learners + actors, the processes share the cores: read 2-learner figures
with ``cpu_count`` and ``loadavg`` in mind. One JSON line on stdout.

Usage::

    python benchmarks/train/bench_train.py                          # 4 cases, a few minutes
    python benchmarks/train/bench_train.py --steps 5000 --cases 1:exact,2:exact
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import common

CASES = ("1:exact", "1:local", "2:exact", "2:local")


def _steady(rows: list[dict[str, str]]) -> dict[str, float | None]:
    """Rates between the first metrics row with updates and the last row."""
    learning = [r for r in rows if int(r["updates"]) > 0]
    if len(learning) < 2:
        return {"env_steps_per_s": None, "updates_per_s": None, "seconds": 0.0}
    first, last = learning[0], learning[-1]
    dt = float(last["wall_s"]) - float(first["wall_s"])
    return {"env_steps_per_s": round((int(last["env_steps"]) - int(first["env_steps"])) / dt, 1),
            "updates_per_s": round((int(last["updates"]) - int(first["updates"])) / dt, 1),
            "seconds": round(dt, 1)}


def run_case(learners: int, mode: str, steps: int, batch: int, work: Path, seed: int,
             timeout_s: float) -> dict[str, Any]:
    """One training run; its throughput figures (see the module docstring)."""
    run_dir = work / f"{learners}-{mode}"
    cmd = [sys.executable, "-m", "shardreplay", "train", "--run-dir", str(run_dir), "--no-progress",
           "--learners", str(learners), "--actors", "2", "--sample-mode", mode,
           "--total-env-steps", str(steps), "--batch-size", str(batch), "--seed", str(seed),
           "--eval-episodes", "1", "--eval-interval-updates", "1000000000", "--stop-return", "none"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steady = _steady(rows)
    wall = float(summary["wall_s"])
    result = {
        "learners": learners, "sample_mode": mode,
        "steady": {**steady, "samples_per_s": None if steady["updates_per_s"] is None
                   else round(steady["updates_per_s"] * batch * learners, 1)},
        "overall": {"env_steps_per_s": round(summary["env_steps"] / wall, 1),
                    "updates_per_s": round(summary["updates"] / wall, 1), "wall_s": wall},
        "env_steps": summary["env_steps"], "updates": summary["updates"],
        "command_s": round(time.perf_counter() - started, 1),
    }
    lags = [float(r["policy_lag"]) for r in rows if r.get("policy_lag") not in (None, "")]
    result["policy_lag_mean"] = round(sum(lags) / len(lags), 1) if lags else None
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the cases and print one JSON line; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=15_000, help="env-step budget of each run")
    p.add_argument("--cases", default=",".join(CASES), help="learners:mode, comma-separated")
    p.add_argument("--batch-size", type=int, default=64, help="windows per rank per update")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    p.add_argument("--out", type=Path, help="also write the JSON line here")
    args = p.parse_args(argv)
    cases = [(int(c.split(":")[0]), c.split(":")[1]) for c in args.cases.split(",")]
    load_before = common.loadavg()
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        results = [run_case(n, mode, args.steps, args.batch_size, Path(tmp), args.seed, args.timeout_s)
                   for n, mode in cases]
    common.emit_line({
        "bench": "train", "env_id": "CartPole-v1", "actors": 2, "envs_per_actor": 4,
        "steps_budget": args.steps, "batch_size": args.batch_size, "results": results,
        "cpu_count": common.cpus(), "loadavg_before": load_before,
        "loadavg_after": common.loadavg(), "python": common.python(), "commit": common.commit(),
    }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
