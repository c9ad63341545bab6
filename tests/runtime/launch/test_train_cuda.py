"""``shardreplay train --device cuda``: learners train on the GPU (network, optimizer and
batches there; DDP over NCCL or, for ranks sharing a GPU, gloo), actors act on it, and
the checkpoint resumes on the CPU with every counter (marked ``cuda``: skipped without a
GPU; ``benchmarks/gpu_check.sh`` runs it on a GPU machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.train_runs import FAST, TrainRun

pytestmark = [pytest.mark.cuda, pytest.mark.slow]


def _train(tmp_path: Path, run_dir: Path, *extra: str) -> dict:
    """One run (``extra`` may be ``--resume RUN_DIR``); its summary."""
    where = [] if "--resume" in extra else ["--run-dir", str(run_dir)]
    args = ["train", *where, *FAST, "--total-env-steps", "3000", "--min-replay", "300",
            "--checkpoint-interval-updates", "50", "--stop-return", "none", *extra]
    with TrainRun(args, tmp_path) as run:
        assert run.wait(400) == 0, run.explain()
        assert run.leftovers() == [], run.explain()
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.timeout(900)
def test_learners_and_actors_on_the_gpu_then_a_resume_on_the_cpu(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _train(tmp_path, run_dir, "--device", "cuda", "--actor-device", "cuda", "--learners", "2",
                   "--actors", "2")
    assert first["updates"] > 0 and first["env_steps"] >= 3000, first
    assert json.loads((run_dir / "config.json").read_text())["learners"]["device"] == "cuda"
    again = _train(tmp_path, run_dir, "--resume", str(run_dir), "--device", "cpu", "--actor-device", "cpu",
                   "--learners", "1", "--total-env-steps", "4000")
    assert again["resumed_from"] and again["updates"] > first["updates"], again
    assert again["env_steps"] >= 4000
