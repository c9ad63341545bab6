"""``train --algo r2d2`` end to end: masked CartPole on 2 learners and 2 actors with a
tiny budget, then resumed on 1 learner (M -> N): the actors' LSTM state stored with the
steps, sequence windows in the sharded replay, the R2D2 learner state in the checkpoint
and restored by the resumed life.

Cost: two short launches (about 35 CPU-s; 40-90 s wall on a loaded 2-core machine).
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from tests.runtime.train_harness import TrainRun, manifest_counters, newest_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

COMMON = ["--algo", "r2d2", "--env-id", "shardreplay/MaskedCartPole-v1", "--no-progress", "--hidden", "16",
          "--n-step", "2", "--seq-len", "8", "--seq-period", "4", "--burn-in", "2", "--batch-size", "8",
          "--min-replay", "20", "--eval-episodes", "1", "--quick-eval-episodes", "1",
          "--eval-interval-updates", "100000", "--stop-return", "0", "--max-minutes", "4", "--seed", "3"]


def _run(args: list[str], log_dir: Path) -> dict:
    with TrainRun(args, log_dir) as run:
        assert run.wait(300) == 0, run.explain()
        assert run.leftovers() == [], run.explain()
        assert "Traceback" not in run.stderr(), run.explain()
        return run.summary()


@pytest.mark.timeout(700)
def test_r2d2_trains_masked_cartpole_on_two_learners_and_resumes_on_one(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _run(["train", "--run-dir", str(run_dir), "--learners", "2", "--actors", "2",
                  "--total-env-steps", "400", *COMMON], tmp_path / "first")
    directory, manifest = newest_checkpoint(run_dir)
    saved = manifest_counters(manifest)
    assert manifest["num_shards"] == 2 and first["updates"] > 0
    assert 400 <= first["env_steps"] == saved["env_steps"]
    state = torch.load(io.BytesIO((directory / "learner_state.pt").read_bytes()), weights_only=True)
    agent = state["agent"]
    assert {"recurrent_online", "target", "optimizer"} <= set(agent) and agent["updates"] == first["updates"]
    assert agent["recurrent_online"]["lstm.weight_hh_l0"].shape == (64, 16)
    second = _run(["train", "--resume", str(run_dir), "--learners", "1",
                   "--total-env-steps", str(saved["env_steps"] + 100)], tmp_path / "second")
    assert second["resumed_from"]["shards"] == 1 and second["resumed_from"]["saved_shards"] == 2
    assert second["updates"] > first["updates"] and second["env_steps"] >= saved["env_steps"] + 100
