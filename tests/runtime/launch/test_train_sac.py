"""``train --algo sac`` end to end: Pendulum-v1 on 2 learners and 2 actors with a tiny
budget, then resumed on 1 learner (M -> N): float actions through the actors, the local
transport and the sharded replay; env steps counted over all ranks; the SAC learner
state in the checkpoint and restored by the resumed life; the run's policy exported and
evaluated (``shardreplay export`` / ``evaluate``, in process).

Cost: two short launches (about 40 s on an idle 2-core machine).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.resume_runs import export_and_evaluate, train_then_resume

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

COMMON = ["--algo", "sac", "--env-id", "Pendulum-v1", "--no-progress", "--no-plot", "--hidden", "32", "32",
          "--min-replay", "200", "--epsilon-warmup-steps", "200", "--eval-episodes", "2",
          "--quick-eval-episodes", "1", "--eval-interval-updates", "100", "--stop-return", "none",
          "--max-minutes", "4", "--seed", "3"]


@pytest.mark.timeout(700)
def test_sac_trains_pendulum_on_two_learners_and_resumes_on_one(tmp_path: Path) -> None:
    r = train_then_resume(tmp_path, COMMON, 800, 300)
    assert r.first["env_steps"] < 800 + 2 * 16 * 8 * 4
    assert -2000 < r.first["final_eval_return"] <= 0
    assert {"actor", "critic", "critic_target", "log_alpha"} <= set(r.agent)
    assert r.agent["actor"]["action_scale"].tolist() == [2.0]  # Pendulum's torque bound
    evaluated = export_and_evaluate(tmp_path / "run", tmp_path / "policy.safetensors", "sac")
    assert -2000 < evaluated["mean_return"] <= 0
