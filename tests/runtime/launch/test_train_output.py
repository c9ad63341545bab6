"""What ``shardreplay train`` leaves a user: one closing sentence on stdout, metrics.csv
ending with the final evaluation (one row per evaluation), TensorBoard events with it, a
time axis that goes on across ``--resume``, summary.json on disk, and the best evaluated
policy in ``best/`` (what ``shardreplay evaluate`` and ``export`` take by default)."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from shardreplay.runtime.policy_file import best_path, load_policy
from tests.support.train_runs import FAST, TrainRun

# Short runs that evaluate often (every 40 updates, 2 episodes) and never stop as solved;
# 8 samples per insert: the step budgets take a quarter of the default's updates (still
# several evaluations each).
SHORT = (*FAST, "--plot", "--min-replay", "200", "--eval-interval-updates", "40", "--stop-return", "none",
         "--samples-per-insert", "8")


def _rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _finish(args: list[str], log_dir: Path, prefix: str) -> TrainRun:
    with TrainRun(args, log_dir, prefix=prefix) as run:
        assert run.wait(240) == 0, run.explain()
        assert run.leftovers() == [], run.explain()
        return run


def _evaluations_logged(stderr: str) -> list[float]:
    return [float(v) for v in re.findall(r"evaluation after \d+ updates: mean return ([\d.]+)", stderr)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_ends_with_one_sentence_and_its_final_evaluation_in_the_metrics(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run = _finish(["train", "--run-dir", str(run_dir), *SHORT, "--total-env-steps", "2500"], tmp_path, "a-")
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = run.stdout().splitlines()
    assert len(lines) == 1, run.explain()
    final = summary["final_eval_return"]
    assert lines[0].startswith(f"Not solved (step budget used up) after {summary['env_steps']:,} environment "
                               f"steps: final evaluation {final:.1f} (mean return of 2 greedy episodes; "
                               "no target: --stop-return none). Files in")
    assert f"{run_dir}/" in lines[0]
    rows = _rows(run_dir)
    # Every evaluation is in exactly one row, in order, the final one in the last row.
    evals = [float(r["eval_return"]) for r in rows if r["eval_return"]]
    logged = _evaluations_logged(run.stderr())  # printed as %.1f
    assert evals == pytest.approx(logged, abs=0.051)
    assert len(evals) >= 2
    last = rows[-1]
    assert float(last["eval_return"]) == pytest.approx(summary["final_eval_return"])
    assert int(last["env_steps"]) == summary["env_steps"] and int(last["updates"]) == summary["updates"]
    assert (run_dir / "learning_curve.png").exists()
    _assert_final_in_tensorboard(run_dir, summary)
    best = load_policy(best_path(run_dir))  # the best of the evaluations, the final one included
    assert float(best.meta["eval_return"]) == pytest.approx(summary["best_eval_return"])
    assert summary["best_eval_return"] == pytest.approx(max(logged), abs=0.051)
    assert int(best.meta["updates"]) <= summary["updates"]

    # --resume: the time axis goes on from the checkpoint's wall time.
    first_life = [float(r["wall_s"]) for r in rows]
    saved = first_life[-1]
    resumed = _finish(["train", "--resume", str(run_dir), "--total-env-steps", "4000"], tmp_path, "b-")
    new_rows = _rows(run_dir)[len(rows):]
    assert new_rows, resumed.explain()
    walls = [float(r["wall_s"]) for r in new_rows]
    assert walls == sorted(walls)
    # The checkpoint was saved just before the final evaluation: within a few seconds.
    assert walls[0] > saved - 10.0 and walls[0] > 0.8 * saved, (walls[:3], saved)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert float(new_rows[-1]["eval_return"]) == pytest.approx(summary["final_eval_return"])
    assert len(resumed.stdout().splitlines()) == 1


def _assert_final_in_tensorboard(run_dir: Path, summary: dict) -> None:
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    evals = acc.Scalars("eval_return")
    assert evals[-1].step == summary["env_steps"]
    assert evals[-1].value == pytest.approx(summary["final_eval_return"], rel=1e-5)
