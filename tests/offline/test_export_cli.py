"""``shardreplay export RUN --minari ID`` on a run directory: the run's env gives the
spaces, its stream layout the actor and stream of each saved row. The run is made by
hand (its config.json and a 2-part checkpoint), not trained: the steps are what a
training run stores, at a fraction of the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import checkpoint
from shardreplay.cli.main import main
from shardreplay.runtime.settings import TrainSettings
from shardreplay.spec import StepType
from tests.checkpoint.helpers import as_shard

minari = pytest.importorskip("minari")

SPEC = sr.Spec({"obs": sr.Field((4,), np.float32), "action": sr.Field((), np.int64),
                "reward": sr.Field((), np.float32)})


def _run(run_dir: Path) -> None:
    """A CartPole run of 2 learners, 2 actors of 2 envs: shard k holds actor k's envs."""
    settings = TrainSettings().updated({"learners": 2, "actors": 2, "envs_per_actor": 2})
    settings = settings.with_run_dir(run_dir)
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(settings.stored()))
    for k in range(2):
        buf = sr.ReplayBuffer(SPEC, num_streams=2, stream_capacity=32, sampler="prioritized")
        for t in range(40):
            st = StepType.FIRST if t % 10 == 0 else StepType.LAST if t % 10 == 9 else StepType.MID
            buf.add({"obs": np.full((2, 4), 100 * k + 10 * np.arange(2)[:, None] + t % 10, np.float32),
                     "action": np.ones(2, np.int64), "reward": np.ones(2, np.float32),
                     "step_type": np.full(2, int(st), np.uint8)})
        checkpoint.save(as_shard(buf, k, 2), run_dir / "checkpoints", 5)


def test_export_names_actor_and_stream_and_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "datasets"))
    _run(tmp_path / "run")
    assert main(["export", str(tmp_path / "run"), "--minari", "sr/cartpole-v0", "--partial", "drop"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["counts"]["dropped_episodes"] == 4  # each row's ring cut its oldest episode
    dataset = minari.load_dataset("sr/cartpole-v0")
    assert dataset.spec.env_spec.id == "CartPole-v1" and dataset.total_episodes == 4 * 3  # 3 whole a row
    for ep in dataset.iterate_episodes():
        shard, row = divmod(int(ep.observations[0, 0]) // 10, 10)
        assert (ep.infos["actor"] == shard).all() and (ep.infos["stream"] == row).all()
        assert ep.observations.shape == (10, 4) and ep.truncations[-1]  # discount 1 at LAST
    assert main(["export", str(tmp_path / "run"), "--minari", "sr/cartpole-v0"]) == 2
    assert "exists already" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "run"), "--minari", "sr/other-v0", "--which", "best"]) == 2
    assert main(["export", str(tmp_path / "run")]) == 2  # neither --out nor --minari
