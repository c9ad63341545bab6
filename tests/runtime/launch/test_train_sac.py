"""``train --algo sac`` end to end: Pendulum-v1 on 2 learners and 2 actors with a tiny
budget, then resumed on 1 learner (M -> N): float actions through the actors, the local
transport and the sharded replay; env steps counted over all ranks; the SAC learner
state in the checkpoint and restored by the resumed life.

Cost: two short launches (about 40 s on an idle 2-core machine).
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from tests.runtime.train_harness import TrainRun, manifest_counters, newest_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

COMMON = ["--algo", "sac", "--env-id", "Pendulum-v1", "--no-progress", "--hidden", "32", "32",
          "--min-replay", "200", "--epsilon-warmup-steps", "200", "--eval-episodes", "2",
          "--quick-eval-episodes", "1", "--eval-interval-updates", "100", "--stop-return", "0",
          "--max-minutes", "4", "--seed", "3"]


def _run(args: list[str], log_dir: Path) -> dict:
    with TrainRun(args, log_dir) as run:
        assert run.wait(300) == 0, run.explain()
        assert run.leftovers() == [], run.explain()
        assert "Traceback" not in run.stderr(), run.explain()
        return run.summary()


@pytest.mark.timeout(700)
def test_sac_trains_pendulum_on_two_learners_and_resumes_on_one(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _run(["train", "--run-dir", str(run_dir), "--learners", "2", "--actors", "2",
                  "--total-env-steps", "800", *COMMON], tmp_path / "first")
    directory, manifest = newest_checkpoint(run_dir)
    saved = manifest_counters(manifest)
    assert manifest["num_shards"] == 2
    # counted over both ranks' shards: the budget is the run's, not each rank's
    assert 800 <= first["env_steps"] == saved["env_steps"] < 800 + 2 * 16 * 8 * 4
    assert first["updates"] > 0 and -2000 < first["final_eval_return"] <= 0
    state = torch.load(io.BytesIO((directory / "learner_state.pt").read_bytes()), weights_only=True)
    agent = state["agent"]
    assert {"actor", "critic", "critic_target", "log_alpha"} <= set(agent)
    assert agent["updates"] == first["updates"]
    assert agent["actor"]["action_scale"].tolist() == [2.0]  # Pendulum's torque bound
    second = _run(["train", "--resume", str(run_dir), "--learners", "1",
                   "--total-env-steps", str(saved["env_steps"] + 300)], tmp_path / "second")
    assert second["resumed_from"]["shards"] == 1 and second["resumed_from"]["saved_shards"] == 2
    assert second["updates"] > first["updates"] and second["env_steps"] >= saved["env_steps"] + 300
