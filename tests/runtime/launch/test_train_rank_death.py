"""A learner rank of ``shardreplay train`` killed with SIGKILL: the launcher names it
(rank, pid, signal), lets the other ranks save their parts, stops every process of the
tree (learners, the actors of every rank, the multiprocessing resource tracker) and
exits non-zero; nothing outlives it, and the surviving ranks' errors say a peer was
lost instead of blaming a 60 s timeout.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shardreplay import checkpoint
from shardreplay.checkpoint.manifest import part_name
from tests.support.train_runs import FAST, TrainRun, training, wait_until

pytestmark = pytest.mark.distributed
START_S = 150.0  # the machine may be loaded: imports alone take seconds per process


def _kill_rank(tmp_path: Path, learners: int, actors: int, rank: int) -> None:
    run_dir = tmp_path / "run"
    args = ["train", "--run-dir", str(run_dir), *FAST, "--learners", str(learners), "--actors", str(actors),
            "--hidden", "32", "32", "--total-env-steps", "100000000"]
    with TrainRun(args, tmp_path / "logs") as run:
        wait_until(lambda: training(run_dir) and len(run.learners()) == learners
                   and len(run.actors()) == actors, START_S, "training with every actor", run)
        # Ranks are started in order: the rank is the learner's place by start time.
        ranks = sorted(run.learners(), key=lambda p: (p.create_time(), p.pid))
        victim = ranks[rank]
        tree = run.descendants()  # recorded in run.seen too, with their start times
        assert any("resource_tracker" in cmd for _t, cmd in run.seen.values()), run.seen
        killed_at = time.monotonic()
        victim.kill()
        code = run.wait(120)
        exited_s = time.monotonic() - killed_at
        # Nothing of the tree may outlive the launcher: no grace here.
        left = run.leftovers(grace_s=0.0)
        assert left == [], f"left after the launcher exited: {left}" + run.explain()
        assert code != 0, run.explain()
        named = f"rank {rank} (pid {victim.pid}) died with SIGKILL"
        assert named in run.stderr(), run.explain()
        assert "did not complete within" not in run.stderr(), run.explain()
        assert exited_s < 45, f"{exited_s:.1f} s from the kill to the launcher's exit" + run.explain()
        print(f"{learners} learners, rank {rank} killed: launcher exited {exited_s:.2f} s later, "
              f"{len(tree)} processes in the tree, none left")
    # The other ranks saved their parts of a checkpoint the dead one never completes.
    root = run_dir / "checkpoints"
    survivors = {f"{part_name(r, learners)}.safetensors" for r in range(learners) if r != rank}
    saved = [sorted(p.name for p in checkpoint.checkpoint_dir(root, c).iterdir())
             for c in checkpoint.list_checkpoints(root)]
    assert any(survivors <= set(names) and f"{part_name(rank, learners)}.safetensors" not in names
               for names in saved), saved


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank", [1, 0])
def test_a_killed_rank_is_named_and_no_process_outlives_the_launcher(tmp_path: Path, rank: int) -> None:
    _kill_rank(tmp_path, learners=2, actors=2, rank=rank)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_middle_rank_of_three_is_named_and_no_process_outlives_the_launcher(
        tmp_path: Path) -> None:
    _kill_rank(tmp_path, learners=3, actors=3, rank=1)
