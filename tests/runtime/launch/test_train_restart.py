"""A run directory is never stuck, and any number of learner ranks can train.

- ``--auto-resume`` over a run directory that holds only incomplete checkpoints (a rank
  died before every rank saved) sets them aside in ``checkpoints/incomplete/<time>/``,
  says so in one line and starts afresh; ``--resume`` refuses such a directory before
  anything starts, telling the user what to do. A restart loop (run, SIGKILL a rank,
  run the same command again) converges to a run that finishes.
- The rate limiter the learners build is valid for every world size (it was refused
  from 3 ranks on). Runs of 1 to 4 learner ranks train and resume with every saved
  step restored: tests/runtime/launch/test_train_layouts.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import checkpoint
from shardreplay.checkpoint.manifest import INCOMPLETE_DIR
from shardreplay.cli.train import _resumable
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.distributed.runner import InlineRunner
from shardreplay.distributed.sharded_buffer import ShardedInternals
from shardreplay.errors import ConfigError
from shardreplay.runtime.envs import transition_spec
from shardreplay.runtime.launch.launcher import prepare_run_dir
from shardreplay.runtime.learner.checkpoints import commit_resume
from shardreplay.runtime.learner.sync import DRAIN_CHUNKS, MAX_UPDATES_PER_ITERATION, make_limiter
from shardreplay.runtime.run_identity import read_identity, upcoming_life
from shardreplay.runtime.settings import TrainSettings
from tests.support.train_runs import (
    FAST,
    TrainRun,
    manifest_counters,
    manifest_steps,
    metrics_rows,
    newest_checkpoint,
    wait_until,
)

START_S = 150.0


# -- the limiter ---------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize(("actors", "remote"), [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (8, 0), (2, 3)])
def test_limiter_settings_are_valid_and_never_stall_for_any_number_of_ranks(
        world: int, actors: int, remote: int) -> None:
    values = dict(learners=world, actors=actors, remote_actors=remote,
                  transport="local" if not remote else "file:///tmp/unused")
    if actors + remote == 0:  # nothing would feed the learners: refused before anything starts
        with pytest.raises(ConfigError, match="no actor would feed the learners"):
            TrainSettings.from_dict(values)
        return
    if 0 < (actors + remote) * 4 < world:  # a shard would get no stream: refused (4 envs each)
        with pytest.raises(ConfigError, match="needs at least"):
            TrainSettings.from_dict(values)
        return
    s = TrainSettings.from_dict(values)
    limiter = make_limiter(s, world)  # raised ConfigError from 3 ranks on
    per_update = s.learners.batch_size * world
    # The learner's loop, with every rank that has actors draining its most each time.
    a = s.actors
    per_iteration = DRAIN_CHUNKS * a.chunk_steps * a.envs_per_actor * min(world, max(actors + remote, 1))
    assert per_iteration <= limiter.max_insert_size
    sampled_once = False
    for _ in range(2000):
        inserted = limiter.can_insert(min(per_iteration, limiter.max_insert_size))
        if inserted:
            limiter.insert(per_iteration)
        sampled = 0
        while sampled < MAX_UPDATES_PER_ITERATION and limiter.can_sample(per_update):
            limiter.sample(per_update)
            sampled += 1
        assert inserted or sampled, f"both sides blocked at {limiter!r}"
        sampled_once = sampled_once or sampled > 0
    assert sampled_once
    ratio = limiter.samples / limiter.inserts
    assert abs(ratio - s.replay.samples_per_insert) / s.replay.samples_per_insert < 0.5, ratio


def test_limiter_window_of_one_and_two_ranks_is_unchanged() -> None:
    """The fix scales with the world size without moving the runs that worked."""
    for world in (1, 2):
        limiter = make_limiter(TrainSettings.from_dict(dict(learners=world)), world)
        offset, slack = 1000 * 32.0, 2 * (16 * 8 * 4 * 2 * 32.0 + 64 * world)
        assert (limiter.min_diff, limiter.max_diff) == (offset - slack, offset + slack)


# -- incomplete checkpoints ----------------------------------------------------------------
def _incomplete_checkpoint(run_dir: Path, cid: int) -> Path:
    """Part 0 of a 2-shard checkpoint (part 1's rank died before saving), and a config."""
    buf = sr.ReplayBuffer(transition_spec(4), num_streams=2, stream_capacity=16, window=4)
    step = {"obs": np.zeros((2, 4), np.float32), "action": np.zeros(2, np.int64),
            "reward": np.ones(2, np.float32), "step_type": np.zeros(2, np.uint8),
            "discount": np.ones(2, np.float32)}
    for _ in range(5):
        buf.add(step)
    stub = object.__new__(ShardedReplayBuffer)
    stub.local, stub.rank, stub.world_size = buf, 0, 2
    # Saved as its sharding_state(): the shard-choice RNG (nothing else is reached).
    rng = np.random.default_rng(0)
    stub._internals = ShardedInternals(None, None, None, rng, InlineRunner(None, None), None)
    directory = checkpoint.save(stub, run_dir / "checkpoints", cid)
    (run_dir / "config.json").write_text(json.dumps(TrainSettings.from_dict(dict(learners=2)).to_dict()))
    assert not checkpoint.is_complete(directory)
    return directory


def _args(run_dir: Path, auto_resume: bool) -> argparse.Namespace:
    return argparse.Namespace(auto_resume=auto_resume, run_dir=str(run_dir), resume=None)


def test_auto_resume_sets_incomplete_checkpoints_aside_and_starts_afresh(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    first = _incomplete_checkpoint(run_dir, 0)
    files = sorted(p.name for p in first.iterdir())
    assert _resumable(_args(run_dir, True)) is None  # nothing complete to continue
    with caplog.at_level(logging.WARNING, logger="shardreplay.train"):
        settings = TrainSettings.from_dict(dict(learners=2, run_dir=str(run_dir)))
        prepare_run_dir(settings, False, auto_resume=True)
    assert checkpoint.list_checkpoints(root) == []
    moved = sorted((root / INCOMPLETE_DIR).iterdir())
    assert len(moved) == 1 and sorted(p.name for p in (moved[0] / first.name).iterdir()) == files
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "starting the run afresh" in lines[0] and "ckpt-0000000000" in lines[0] \
        and str(moved[0]) in lines[0], lines
    # The loop goes round again: the next crash's leftovers go beside, nothing is overwritten.
    _incomplete_checkpoint(run_dir, 0)
    prepare_run_dir(TrainSettings.from_dict(dict(learners=2, run_dir=str(run_dir))), False, auto_resume=True)
    again = sorted((root / INCOMPLETE_DIR).iterdir())
    assert len(again) == 2 and all((d / first.name).is_dir() for d in again)


def test_auto_resume_continues_from_a_complete_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _incomplete_checkpoint(run_dir, 3)
    buf = sr.ReplayBuffer(transition_spec(4), num_streams=2, stream_capacity=16, window=4)
    checkpoint.save(buf, run_dir / "checkpoints", 1)
    assert _resumable(_args(run_dir, True)) == run_dir
    settings = prepare_run_dir(TrainSettings.from_dict(dict(run_dir=str(run_dir))), True)
    # Nothing moves before every rank restored (a refused resume changes nothing) ...
    assert checkpoint.list_checkpoints(run_dir / "checkpoints") == [1, 3]
    assert not (run_dir / "run.json").exists()
    # ... then the resumed life sets the newer incomplete one aside too (no later save
    # mixes with its parts) and records itself.
    upcoming_life_before = upcoming_life(run_dir)
    commit_resume(run_dir, upcoming_life_before, settings.to_dict(), restored=1)
    assert checkpoint.list_checkpoints(run_dir / "checkpoints") == [1]
    assert read_identity(run_dir) == upcoming_life_before
    assert json.loads((run_dir / "config.json").read_text())["run"]["run_dir"] == str(run_dir)


def test_a_resumed_life_reads_no_checkpoint_older_than_the_one_restored(tmp_path: Path) -> None:
    # Each commit used to re-hash every checkpoint of the run, each with every earlier part
    # it refers to: past ~240 incremental checkpoints that took over the 60 s the other rank
    # waits, and every relaunch of the soak failed. An older one is never read again, so a
    # damaged old one stays where it is (the restore never reached it); the newer ones go.
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    buf = sr.ReplayBuffer(transition_spec(4), num_streams=1, stream_capacity=16, window=4)
    for cid in (1, 2, 3):
        checkpoint.save(buf, root, cid, keep_last=None)
    _incomplete_checkpoint(run_dir, 5)
    part = checkpoint.checkpoint_dir(root, 1) / "part-00000-of-00001.safetensors"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01
    part.write_bytes(bytes(data))
    assert not checkpoint.is_complete(checkpoint.checkpoint_dir(root, 1))
    settings = prepare_run_dir(TrainSettings.from_dict(dict(run_dir=str(run_dir))), True)
    commit_resume(run_dir, upcoming_life(run_dir), settings.to_dict(), restored=3)
    assert checkpoint.list_checkpoints(root) == [1, 2, 3]
    (aside,) = (root / INCOMPLETE_DIR).iterdir()
    assert [d.name for d in aside.iterdir()] == [checkpoint.checkpoint_dir(root, 5).name]


def _train_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardreplay", "train", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_resume_or_new_run_over_only_incomplete_checkpoints_is_refused_with_what_to_do(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    directory = _incomplete_checkpoint(run_dir, 0)
    got = _train_cli("--resume", str(run_dir), "--no-progress")
    assert got.returncode == 2, got.stderr
    assert "no complete checkpoint" in got.stderr and "--auto-resume" in got.stderr, got.stderr
    assert "Traceback" not in got.stderr and "learner" not in got.stderr  # refused before starting
    got = _train_cli("--run-dir", str(run_dir), "--no-progress")
    assert got.returncode == 2 and "only incomplete checkpoints" in got.stderr \
        and "--auto-resume" in got.stderr, got.stderr
    assert directory.is_dir()  # neither command touched it


# -- the real command ----------------------------------------------------------------------
def _finish(args: list[str], log_dir: Path, timeout_s: float = 300) -> dict:
    with TrainRun(args, log_dir) as run:
        assert run.wait(timeout_s) == 0, run.explain()
        assert run.leftovers() == [], run.explain()
        return run.summary()


def _training_again(run_dir: Path, rows_before: int) -> bool:
    """This life of the run recorded an update (rows from earlier lives do not count)."""
    rows = metrics_rows(run_dir)[rows_before:]
    return bool(rows) and int(rows[-1]["updates"]) >= 1


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_a_restart_loop_after_rank_kills_converges(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["train", "--run-dir", str(run_dir), "--auto-resume", *FAST, "--learners", "2", "--actors", "2",
            "--hidden", "32", "32"]
    for attempt in range(2):  # the scheduler restarts it after each crash
        before = len(metrics_rows(run_dir))  # metrics.csv is appended to by every life
        with TrainRun([*args, "--total-env-steps", "100000000"], tmp_path / f"crash{attempt}") as run:
            wait_until(lambda run=run, before=before: _training_again(run_dir, before)
                       and len(run.learners()) == 2, START_S, "training", run)
            victim = max(run.learners(), key=lambda p: p.pid)
            victim.kill()
            assert run.wait(200) != 0, run.explain()
            assert run.leftovers() == [], run.explain()
        assert checkpoint.latest_complete(run_dir / "checkpoints") is None
        assert checkpoint.list_checkpoints(run_dir / "checkpoints"), "the crash saved nothing"
    summary = _finish([*args, "--total-env-steps", "1500"], tmp_path / "last")
    assert summary["resumed_from"] is None and summary["env_steps"] >= 1500
    _directory, manifest = newest_checkpoint(run_dir)
    assert manifest_steps(manifest) == manifest_counters(manifest)["env_steps"]
    kept = sorted((run_dir / "checkpoints" / INCOMPLETE_DIR).iterdir())
    assert len(kept) == 2  # each crash's parts, set aside, not deleted
