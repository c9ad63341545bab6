"""``shardreplay train`` on pixels: an env registered by ``--env-import`` learns through a
file:// transport, Atari runs with frame-stacked replay, and ``--compression auto`` packs
frame stacks on the wire."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from shardreplay.checkpoint import load_manifest
from shardreplay.runtime.envs import EnvInfo, transition_spec
from shardreplay.runtime.routing import shard_transport
from tests.support.gym_envs import write_blink_env
from tests.support.train_runs import FAST, TrainRun


def _env_with_path(directory: Path) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_image_env_registered_by_import_learns_through_a_file_spool(tmp_path: Path) -> None:
    """Blink-v0 (12x12 RGB, channels last, reward 1 for naming the lit edge: a random
    policy scores 5 of 10) is imported by the actors and the learner, turned channels
    first, learned by the small convolutional network, and solved (10 of 10)."""
    module = write_blink_env(tmp_path)
    run_dir = tmp_path / "run"
    args = ["train", "--env-id", "Blink-v0", "--env-import", module, "--env-kwargs", '{"length": 10}',
            "--transport", (tmp_path / "spool").absolute().as_uri(), "--run-dir", str(run_dir), *FAST,
            "--actors", "1", "--total-env-steps", "6000", "--min-replay", "200",
            "--eval-interval-updates", "40", "--eval-episodes", "4", "--stop-return", "9.5"]
    with TrainRun(args, tmp_path, env=_env_with_path(tmp_path)) as run:
        assert run.wait(500) == 0, run.explain()
        assert run.leftovers() == [], run.explain()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["solved"] and summary["final_eval_return"] >= 9.5, summary
    assert summary["chunks_rejected"] == 0
    config = json.loads((run_dir / "config.json").read_text())
    assert config["learners"]["network"] == "auto" and config["run"]["env_import"] == module


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_atari_trains_on_frame_stacked_replay(tmp_path: Path) -> None:
    """ALE/Pong-v5 with the DQN preprocessing: 4x84x84 uint8 stacks stored once per frame,
    the Nature network, chunks packed on a file:// spool; the checkpoint holds the
    frame-stacked field."""
    pytest.importorskip("ale_py")  # the atari extra: part of the test extra (CI has it)
    run_dir = tmp_path / "run"
    args = ["train", "--env-id", "ALE/Pong-v5", "--env-kwargs", '{"max_num_frames_per_episode": 400}',
            "--transport", (tmp_path / "spool").absolute().as_uri(), "--run-dir", str(run_dir), *FAST,
            "--actors", "1", "--envs-per-actor", "2", "--total-env-steps", "400", "--min-replay", "100",
            "--batch-size", "8", "--replay-capacity", "2000", "--eval-episodes", "1", "--stop-return", "none"]
    with TrainRun(args, tmp_path) as run:
        assert run.wait(500) == 0, run.explain()
        assert run.leftovers() == [], run.explain()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env_steps"] >= 400 and summary["updates"] > 0 and summary["chunks_rejected"] == 0, summary
    obs = load_manifest(Path(summary["checkpoint"])).spec.fields["obs"]
    assert (obs.shape, obs.dtype, obs.frame_stack) == ((4, 84, 84), np.uint8, True)


def test_auto_compression_packs_frame_stacks_only(tmp_path: Path) -> None:
    url = tmp_path.absolute().as_uri()
    stacked = transition_spec(EnvInfo((4, 84, 84), np.dtype(np.uint8), 6, frame_stack=4))
    assert shard_transport(url, stacked, 0, compression="auto").compression == "lz4"
    assert shard_transport(url, transition_spec(4), 0, compression="auto").compression == "none"
    assert shard_transport(url, transition_spec(4), 0, compression="zstd").compression == "zstd"
