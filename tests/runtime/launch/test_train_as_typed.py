"""``shardreplay train`` as a user types it (issue 40): a target that fits the env (any
number, ``none``: never) and a run directory that moves.

One chain of two launches, each checked for several things. The first run's target is a
negative number, which CartPole's returns (at least 1) pass at the first evaluation: it
is solved, and its last sentence says which target applied and where it came from
(before, ``<= 0`` meant "never" and the run used its whole budget); ``best/`` holds the
network of a full evaluation (before, a quick one of fewer episodes could make it). Its run directory is
then moved, and ``--resume`` of the new place must publish there (before, config.json
held the old absolute policy path, and the resumed run wrote into the old place).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardreplay.runtime.policy_file import best_path, load_policy
from tests.support.train_runs import FAST, TrainRun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _train(args: list[str], log_dir: Path, prefix: str) -> TrainRun:
    with TrainRun(["train", *args], log_dir, prefix=prefix) as run:
        assert run.wait(240) == 0, run.explain()
        assert run.leftovers() == [], run.explain()
        assert "Traceback" not in run.stderr(), run.explain()
        return run


def test_a_negative_target_solves_and_a_moved_run_directory_resumes_into_itself(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "op"
    first = _train(["--run-dir", str(run_dir), *FAST, "--stop-return", "-1", "--eval-interval-updates", "20",
                    "--quick-eval-episodes", "1", "--eval-episodes", "3", "--total-env-steps", "3000"],
                   tmp_path, "a-")
    (line,) = first.stdout().splitlines()
    assert line.startswith("Solved after") and "; target -1 from --stop-return)" in line, line
    # best/ holds a network of a full evaluation (3 episodes), not of a quick one (1)
    assert load_policy(best_path(run_dir)).meta["eval_episodes"] == "3"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["transport"]["policy_url"] == "file://{run_dir}/policy", config["transport"]
    steps = json.loads((run_dir / "summary.json").read_text())["env_steps"]

    moved = tmp_path / "runs" / "op-moved"
    run_dir.rename(moved)
    second = _train(["--resume", str(moved), "--stop-return", "none", "--total-env-steps", str(steps + 300)],
                    tmp_path, "b-")
    (line,) = second.stdout().splitlines()
    assert line.startswith("Not solved (step budget used up)"), line
    assert "; no target: --stop-return none)" in line and f"Files in {moved}/" in line, line
    assert not run_dir.exists(), sorted(p.name for p in run_dir.rglob("*"))  # nothing went to the old place
    summary = json.loads((moved / "summary.json").read_text())
    assert summary["resumed_from"] is not None and summary["stop_return"] is None
    published = sorted((moved / "policy").glob("*.safetensors"))
    assert published and max(p.stat().st_mtime for p in published) >= second.started_at
