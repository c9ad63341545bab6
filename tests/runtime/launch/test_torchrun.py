"""``shardreplay train`` under ``torchrun`` (gloo, 2 ranks on loopback): local actors,
remote ``shardreplay actor`` processes through a real Redis, Ctrl-C, a missing run dir."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import free_port
from tests.support.train_runs import (
    FAST,
    TrainRun,
    manifest_counters,
    manifest_steps,
    newest_checkpoint,
    training,
    wait_until,
)

pytestmark = pytest.mark.distributed


def _torchrun(*train_args: str) -> list[str]:
    return ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "shardreplay", "train", *train_args]


def _assert_two_shard_checkpoint(run_dir: Path, env_steps: int) -> None:
    _directory, manifest = newest_checkpoint(run_dir)
    assert manifest.num_shards == 2
    assert all(p.steps > 0 for p in manifest.parts), manifest.parts  # both shards fed
    assert manifest_counters(manifest)["env_steps"] == env_steps == manifest_steps(manifest)


@pytest.mark.timeout(300)
def test_torchrun_two_ranks_with_local_actors(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with TrainRun(_torchrun("--run-dir", str(run_dir), *FAST, "--plot", "--actors", "2",
                            "--total-env-steps", "2000"),
                  tmp_path, module="torch.distributed.run") as run:
        assert run.wait(240) == 0, run.explain()
        summary = run.summary()
        assert summary["env_steps"] >= 2000
        _assert_two_shard_checkpoint(run_dir, summary["env_steps"])
        assert run.leftovers() == [], run.explain()
        # One closing sentence for the run (rank 0's), and log lines that name their rank.
        lines = run.stdout().splitlines()
        assert len(lines) == 1 and lines[0].endswith("learning_curve.png, checkpoints/)."), run.explain()
        assert re.search(r" rank 1 shardreplay\.", run.stderr()), run.explain()
        assert re.search(r" rank 0 shardreplay\.", run.stderr()), run.explain()


@pytest.mark.redis
@pytest.mark.timeout(360)
def test_torchrun_learners_with_remote_actors_through_redis(tmp_path: Path, redis_server) -> None:
    url = redis_server.url
    run_dir = tmp_path / "run"
    actors = [TrainRun(["actor", "--actor-id", str(a), "--num-actors", "2", "--num-shards", "2",
                        "--transport", url, "--policy-url", url, "--queued-chunks-per-actor", "2",
                        "--seed", str(a)], tmp_path, prefix=f"actor{a}-") for a in range(2)]
    try:
        with TrainRun(_torchrun("--run-dir", str(run_dir), *FAST, "--actors", "0", "--remote-actors", "2",
                                "--transport", url, "--total-env-steps", "2000", "--hidden", "256", "256"),
                      tmp_path, module="torch.distributed.run") as learners:
            assert learners.wait(240) == 0, learners.explain()
            summary = learners.summary()
            assert summary["env_steps"] >= 2000
            _assert_two_shard_checkpoint(run_dir, summary["env_steps"])
            assert learners.leftovers() == [], learners.explain()
        for actor in actors:  # the learners published 'finished': the actors end by themselves
            assert actor.wait(60) == 0, actor.explain()
            assert actor.summary()["env_steps"] > 0
            assert "hidden sizes (256, 256) from the published policy" in actor.stderr()
            assert actor.leftovers() == []
    finally:
        for actor in actors:
            actor.close()


@pytest.mark.timeout(300)
def test_torchrun_ctrl_c_checkpoints_both_ranks(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = _torchrun("--run-dir", str(run_dir), *FAST, "--actors", "2", "--total-env-steps", "100000000")
    with TrainRun(args, tmp_path, module="torch.distributed.run") as run:
        wait_until(lambda: training(run_dir), 150, "training", run)
        run.ctrl_c()
        run.wait(120)  # torchrun itself reports the signal (exit 1, SignalException)
        _directory, manifest = newest_checkpoint(run_dir)
        assert manifest.num_shards == 2
        assert manifest_steps(manifest) == manifest_counters(manifest)["env_steps"] > 0
        assert run.leftovers() == [], run.explain()


@pytest.mark.timeout(200)
def test_torchrun_needs_a_shared_run_dir(tmp_path: Path) -> None:
    with TrainRun(_torchrun(*FAST), tmp_path, module="torch.distributed.run") as run:
        assert run.wait(150) != 0
        assert "every learner rank needs the same --run-dir" in run.stderr(), run.explain()
        assert run.leftovers() == []
