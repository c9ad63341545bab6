"""Evidence that distributed training learns: 2 learners and 2 actors, a checkpoint, a
resume on 1 learner, and a final greedy return far above a random policy's.

CartPole-v1: a uniformly random policy returns about 22 on average. The run uses the
training defaults with a small step budget and fixed seeds; the final evaluation (20
greedy episodes) must at least double the random policy's mean over the same number of
episodes, measured here with the same evaluation code.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from shardreplay.runtime.policy_file import evaluate
from tests.support.train_runs import TrainRun, manifest_counters, newest_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
EPISODES = 20


class _RandomQ(nn.Module):
    """Random Q-values: the greedy action is uniformly random."""

    def __init__(self, num_actions: int, seed: int) -> None:
        super().__init__()
        self.num_actions = num_actions
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.rand(obs.shape[0], self.num_actions, generator=self.gen)


def _run(args: list[str], log_dir: Path) -> dict:
    with TrainRun(args, log_dir) as run:
        assert run.wait(240) == 0, run.explain()
        assert run.leftovers() == [], run.explain()
        return run.summary()


@pytest.mark.timeout(600)
def test_two_learners_then_one_learn_cartpole_beyond_a_random_policy(tmp_path: Path) -> None:
    random_mean = float(np.mean(evaluate(_RandomQ(2, seed=0), "CartPole-v1", EPISODES, seed=10_000)))
    assert 15 < random_mean < 35  # the baseline is what it should be
    run_dir = tmp_path / "run"
    # --stop-return none: both runs use their whole step budget (an early "solved" stop would
    # end the second run before the budget this test checks).
    common = ["--no-progress", "--no-plot", "--eval-episodes", str(EPISODES), "--seed", "1",
              "--max-minutes", "3", "--stop-return", "none"]
    first = _run(["train", "--run-dir", str(run_dir), "--learners", "2", "--actors", "2",
                  "--total-env-steps", "4000", *common], tmp_path / "first")
    _directory, manifest = newest_checkpoint(run_dir)
    assert manifest.num_shards == 2
    saved = manifest_counters(manifest)
    second = _run(["train", "--resume", str(run_dir), "--learners", "1",
                   "--total-env-steps", str(saved["env_steps"] + 5000)], tmp_path / "second")
    assert second["resumed_from"]["shards"] == 1 and second["resumed_from"]["saved_shards"] == 2
    assert second["updates"] > saved["updates"] and second["env_steps"] >= saved["env_steps"] + 5000
    newest_checkpoint(run_dir)
    final = second["final_eval_return"]
    print(f"random policy {random_mean:.1f}; after 2 learners {first['final_eval_return']:.1f} "
          f"({first['updates']} updates); after resuming on 1 learner {final:.1f} "
          f"({second['updates']} updates)")
    assert final >= 2 * random_mean, (final, random_mean)
