"""``train --algo r2d2`` end to end: masked CartPole on 2 learners and 2 actors with a
tiny budget, then resumed on 1 learner (M -> N): the actors' LSTM state stored with the
steps, sequence windows in the sharded replay, the R2D2 learner state in the checkpoint
and restored by the resumed life; the run's policy exported and evaluated
(``shardreplay export`` / ``evaluate``, in process).

Cost: two short launches (about 35 CPU-s; 40-90 s wall on a loaded 2-core machine).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.resume_runs import export_and_evaluate, train_then_resume

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

COMMON = ["--algo", "r2d2", "--env-id", "shardreplay/MaskedCartPole-v1", "--no-progress", "--no-plot",
          "--hidden", "16", "--n-step", "2", "--seq-len", "8", "--seq-period", "4", "--burn-in", "2",
          "--batch-size", "8", "--min-replay", "20", "--eval-episodes", "1", "--quick-eval-episodes", "1",
          "--eval-interval-updates", "100000", "--stop-return", "none", "--max-minutes", "4", "--seed", "3"]


@pytest.mark.timeout(700)
def test_r2d2_trains_masked_cartpole_on_two_learners_and_resumes_on_one(tmp_path: Path) -> None:
    r = train_then_resume(tmp_path, COMMON, 400, 100)
    assert {"recurrent_online", "target", "optimizer"} <= set(r.agent)
    assert r.agent["recurrent_online"]["lstm.weight_hh_l0"].shape == (64, 16)
    evaluated = export_and_evaluate(tmp_path / "run", tmp_path / "policy.safetensors", "r2d2")
    assert evaluated["mean_return"] >= 8  # CartPole lasts >= 8 steps
