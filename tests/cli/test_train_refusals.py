"""``shardreplay train`` refuses what cannot run before anything starts (issue 40, item 4):
one line on stderr, exit 2, no run directory and no process (the command, as a user
types it, started none: no fork server, no learner, no actor).

Before: ``--device cuda`` without CUDA started the ranks and failed 7 s later with three
lines advising ``--auto-resume``; ``--algo r2d2`` with an image env made the run
directory before refusing; ``--actors 0`` without remote actors trained on nothing until
the time limit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.gym_envs import write_blink_env
from tests.support.train_runs import FAST, TrainRun


def _cuda_missing() -> str:
    """A CUDA device this machine does not have: ``cuda`` without CUDA, else one past the last."""
    import torch

    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


@pytest.mark.parametrize(("extra", "expected"), [
    (("--device", "CUDA_MISSING"), ("--device cuda", "use --device cpu")),
    (("--actor-device", "CUDA_MISSING"), ("--actor-device cuda", "use --actor-device cpu")),
    (("--algo", "r2d2", "--env-id", "Blink-v0", "--env-import", "BLINK"),
     ("--algo r2d2 takes flat vector observations", "[3, 12, 12]")),
    (("--actors", "0"), ("no actor would feed the learners", "--remote-actors N")),
    (("--no-replay",), ("--no-replay needs --resume RUN_DIR",)),
], ids=["device", "actor-device", "r2d2-images", "no-actors", "no-replay-without-resume"])
def test_what_cannot_run_is_refused_in_one_line_before_anything_starts(
        tmp_path: Path, extra: tuple[str, ...], expected: tuple[str, ...]) -> None:
    module = write_blink_env(tmp_path)
    args = [module if a == "BLINK" else _cuda_missing() if a == "CUDA_MISSING" else a for a in extra]
    run_dir = tmp_path / "run"
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)}
    with TrainRun(["train", "--run-dir", str(run_dir), *FAST, *args], tmp_path, env=env) as run:
        assert run.wait(120) == 2, run.explain()
        assert run.seen == {}, run.explain()  # no process was started
    (line,) = run.stderr().splitlines()
    assert line.startswith("shardreplay train: ") and all(e in line for e in expected), line
    assert run.stdout() == "" and not run_dir.exists()
