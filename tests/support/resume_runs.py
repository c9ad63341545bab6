"""An algorithm's ``train`` run on 2 learners and 2 actors, then resumed on 1 learner
(M -> N), with the checks every algorithm shares; the launch tests of ``--algo sac`` and
``--algo r2d2`` add their own on what it returns.

Import as ``from tests.support.resume_runs import ...`` (it launches ``shardreplay train``
through :mod:`tests.support.train_runs`).
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardreplay.cli.main import main as cli_main
from shardreplay.runtime.policy_file import load_policy
from tests.support.train_runs import TrainRun, manifest_counters, newest_checkpoint


@dataclass(frozen=True)
class Resumed:
    """What the two lives left: their summaries, the counters of the checkpoint the first
    one saved last, and the learner state in it (``learner_state.pt``'s ``agent``)."""

    first: dict[str, Any]
    second: dict[str, Any]
    saved: dict[str, int]
    agent: dict[str, Any]


def run_train(args: list[str], log_dir: Path) -> dict[str, Any]:
    """``shardreplay train args``: exits 0 within 300 s, leaves no process and no
    traceback; returns its summary."""
    with TrainRun(args, log_dir) as run:
        assert run.wait(300) == 0, run.explain()
        assert run.leftovers() == [], run.explain()
        assert "Traceback" not in run.stderr(), run.explain()
        return run.summary()


def train_then_resume(tmp_path: Path, algo_args: list[str], steps: int, more_steps: int) -> Resumed:
    """Train ``steps`` env steps on 2 learners and 2 actors with ``algo_args``, then resume
    on 1 learner for ``more_steps`` more; checks the 2 shards saved and restored onto 1,
    env steps counted over both ranks, the update count saved with the learner state and
    growing in the second life.
    """
    run_dir = tmp_path / "run"
    first = run_train(["train", "--run-dir", str(run_dir), "--learners", "2", "--actors", "2",
                       "--total-env-steps", str(steps), *algo_args], tmp_path / "first")
    directory, manifest = newest_checkpoint(run_dir)
    saved = manifest_counters(manifest)
    assert manifest.num_shards == 2 and first["updates"] > 0
    # counted over both ranks' shards: the budget is the run's, not each rank's
    assert steps <= first["env_steps"] == saved["env_steps"]
    agent = torch.load(io.BytesIO((directory / "learner_state.pt").read_bytes()), weights_only=True)["agent"]
    assert agent["updates"] == first["updates"]
    second = run_train(["train", "--resume", str(run_dir), "--learners", "1",
                        "--total-env-steps", str(saved["env_steps"] + more_steps)], tmp_path / "second")
    assert second["resumed_from"]["shards"] == 1 and second["resumed_from"]["saved_shards"] == 2
    assert second["updates"] > first["updates"] and second["env_steps"] >= saved["env_steps"] + more_steps
    return Resumed(first, second, saved, agent)


def export_and_evaluate(run_dir: Path, out: Path, algo: str) -> dict[str, Any]:
    """``shardreplay export`` and ``evaluate --episodes 1`` of a finished run (in process):
    both exit 0, the file rebuilds ``algo``'s network; returns evaluate's JSON line."""
    lines = io.StringIO()
    with contextlib.redirect_stdout(lines):
        assert cli_main(["export", str(run_dir), "--out", str(out)]) == 0
        assert cli_main(["evaluate", str(run_dir), "--episodes", "1"]) == 0
    exported, evaluated = (json.loads(line) for line in lines.getvalue().splitlines())
    assert exported["algo"] == evaluated["algo"] == load_policy(out).algo == algo
    return dict(evaluated)
