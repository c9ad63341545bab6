"""``shardreplay train`` as real process trees: stop, resume, crashed actors, bad input.

Each test runs the real command in its own session, signals it as a terminal user
would, and checks with psutil that no process of its tree is left; the harness kills
the whole tree whatever happens (see ``tests/support/train_runs.py``).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest

from tests.support.train_runs import (
    FAST,
    TrainRun,
    manifest_counters,
    manifest_steps,
    metrics_rows,
    newest_checkpoint,
    training,
    wait_until,
)

pytestmark = pytest.mark.distributed
START_S = 150.0  # the machine may be loaded: imports alone take seconds per process
UNBOUNDED = ("--total-env-steps", "100000000")


def _train_args(run_dir: Path, *extra: str) -> list[str]:
    return ["train", "--run-dir", str(run_dir), *FAST, *extra]


def _assert_stopped_cleanly(run: TrainRun, run_dir: Path, learners: int) -> dict:
    """Exit 0, every rank's part in one complete checkpoint holding every counted step,
    the summary agreeing with it, no process left, no traceback."""
    rc = run.wait(150)
    assert rc == 0, run.explain()
    summary = run.summary()
    directory, manifest = newest_checkpoint(run_dir)
    assert manifest.num_shards == learners
    assert sorted(p.shard for p in manifest.parts) == list(range(learners))
    assert Path(summary["checkpoint"]) == directory
    assert (directory / "learner_state.pt").exists()
    counters = manifest_counters(manifest)
    assert counters["env_steps"] == summary["env_steps"] > 0
    assert counters["updates"] == summary["updates"]
    # What the actors sent while stopping was drained and counted: nothing is lost.
    assert manifest_steps(manifest) == counters["env_steps"]
    assert run.leftovers() == [], run.explain()
    assert "Traceback" not in run.stderr(), run.explain()
    return summary


@pytest.mark.timeout(420)
@pytest.mark.parametrize("how", ["ctrl_c", "sigterm_launcher"])
def test_stop_checkpoints_every_rank_and_leaves_no_process(tmp_path: Path, how: str) -> None:
    run_dir = tmp_path / "run"
    with TrainRun(_train_args(run_dir, "--learners", "2", "--actors", "2", *UNBOUNDED), tmp_path) as run:
        wait_until(lambda: training(run_dir), START_S, "training", run)
        wait_until(lambda: len(run.learners()) == 2 and len(run.actors()) == 2, 30,
                   "2 learners and 2 actors", run)
        if how == "ctrl_c":
            run.ctrl_c()
        else:
            run.terminate_launcher()
        summary = _assert_stopped_cleanly(run, run_dir, learners=2)
        assert summary["updates"] >= 1
        assert len(run.seen) >= 4  # 2 learners, 2 actors (and the resource tracker)


@pytest.mark.timeout(300)
def test_ctrl_c_while_starting_exits_0_and_leaves_no_process(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with TrainRun(_train_args(run_dir, "--learners", "2", *UNBOUNDED), tmp_path) as run:
        wait_until(lambda: len(run.learners()) >= 1, START_S, "the first learner process", run,
                   poll_s=0.05)
        run.ctrl_c()
        assert run.wait(150) == 0, run.explain()
        assert run.leftovers() == [], run.explain()
        assert "Traceback" not in run.stderr(), run.explain()
        if (run_dir / "checkpoints").exists() and os.listdir(run_dir / "checkpoints"):
            newest_checkpoint(run_dir)  # whatever was saved is complete


def _finished_run(args: list[str], log_dir: Path, timeout_s: float = 240) -> dict:
    with TrainRun(args, log_dir) as run:
        assert run.wait(timeout_s) == 0, run.explain()
        assert run.leftovers() == [], run.explain()
        return run.summary()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_continues_counters_and_replay_on_another_number_of_learners(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    budget = 1500
    # --auto-resume starts a new run when there is nothing to continue ... (with
    # prefetched sampling: queued priority updates are flushed before each agreed save)
    first = _finished_run(_train_args(run_dir, "--auto-resume", "--learners", "2", "--prefetch", "4",
                                      "--samples-per-insert", "8", "--total-env-steps", str(budget)),
                          tmp_path / "a")  # 8 samples per insert: fewer updates, kept by the resumes
    assert first["resumed_from"] is None
    previous = first
    for step, learners in enumerate((1, 2), start=1):  # 2 -> 1, then 1 -> 2
        saved_dir, saved = newest_checkpoint(run_dir)
        saved_counters = manifest_counters(saved)
        rows_before = len(metrics_rows(run_dir))
        target = saved_counters["env_steps"] + budget
        # ... and continues one that has a checkpoint, as --resume does.
        how = ["--resume", str(run_dir)] if step == 1 else ["--run-dir", str(run_dir), "--auto-resume"]
        summary = _finished_run(["train", *how, "--learners", str(learners),
                                 "--total-env-steps", str(target)], tmp_path / f"resume{step}")
        resumed = summary["resumed_from"]
        assert resumed["checkpoint"] == saved_dir.name
        assert (resumed["saved_shards"], resumed["shards"]) == (previous_learners(step), learners)
        assert resumed["steps"] == manifest_steps(saved)  # every saved step came back
        # Counters continue from the saved ones.
        assert summary["env_steps"] >= target
        assert summary["updates"] >= saved_counters["updates"]
        assert summary["samples"] >= saved_counters["samples"]
        new_rows = metrics_rows(run_dir)[rows_before:]
        assert new_rows, "the resumed run recorded no metrics"
        assert all(int(r["env_steps"]) >= saved_counters["env_steps"] for r in new_rows)
        assert all(int(r["updates"]) >= saved_counters["updates"] for r in new_rows)
        # The new checkpoint: one part per new learner, old steps plus new ones.
        new_dir, new = newest_checkpoint(run_dir)
        assert new_dir != saved_dir and new.num_shards == learners
        assert manifest_counters(new)["env_steps"] == summary["env_steps"]
        added = summary["env_steps"] - saved_counters["env_steps"]
        assert manifest_steps(new) == manifest_steps(saved) + added
        config = json.loads((run_dir / "config.json").read_text())
        assert (config["learners"]["count"], config["replay"]["prefetch"]) == (learners, 4)
        previous = summary
    assert previous["env_steps"] >= 3 * budget
    # Every life stopped cleanly: no chunk was acknowledged and then lost (no false report
    # from the logs that each resume reads).
    assert not (run_dir / "lost_chunks.jsonl").exists()


def previous_learners(step: int) -> int:
    """Learners of the run before resume number ``step`` (2, then 1)."""
    return {1: 2, 2: 1}[step]


@pytest.mark.timeout(300)
def test_a_solved_run_stops_and_keeps_the_agent_that_passed(tmp_path: Path) -> None:
    """The ranks stop a few updates after the evaluation that passed; the checkpoint (and
    the published and finally evaluated policy) is the agent of that evaluation."""
    import torch

    run_dir = tmp_path / "run"
    every = 44  # not a multiple of the 8 updates an iteration may run: the solving one is mid-way
    summary = _finished_run(["train", "--run-dir", str(run_dir), "--no-progress", "--no-plot",
                             "--learners", "1", "--actors", "1", "--min-replay", "200",
                             "--eval-interval-updates", str(every), "--samples-per-insert", "128",
                             "--quick-eval-episodes", "3", "--eval-episodes", "5", "--stop-return", "15",
                             "--total-env-steps", "200000", "--max-minutes", "4"], tmp_path)
    assert summary["solved"] and summary["env_steps"] < 200_000
    directory, _manifest = newest_checkpoint(run_dir)
    state = torch.load(directory / "learner_state.pt", weights_only=True)
    passed = int(state["agent"]["updates"])
    assert passed % every == 0 and 0 < passed <= summary["updates"], (passed, summary["updates"])


@pytest.mark.timeout(420)
def test_crashed_actor_is_restarted_up_to_the_bound_and_training_goes_on(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = _train_args(run_dir, "--learners", "1", "--actors", "2", "--max-actor-restarts", "1", *UNBOUNDED)
    with TrainRun(args, tmp_path) as run:
        wait_until(lambda: training(run_dir), START_S, "training", run)
        wait_until(lambda: len(run.actors()) == 2, 30, "2 actors", run)
        first = {a.pid for a in run.actors()}
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: "restart 1 of 1" in run.stderr(), 60, "the restart log line", run)
        wait_until(lambda: len(run.actors()) == 2 and {a.pid for a in run.actors()} != first, 60,
                   "a restarted actor", run)
        restarted = ({a.pid for a in run.actors()} - first).pop()
        # The restarted actor works: steps keep coming while only it and the other run.
        os.kill(restarted, signal.SIGKILL)  # second crash of the same actor: beyond the bound
        wait_until(lambda: "not restarted" in run.stderr(), 60, "the give-up log line", run)
        assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE
        steps_then = int(metrics_rows(run_dir)[-1]["env_steps"])
        wait_until(lambda: int(metrics_rows(run_dir)[-1]["env_steps"]) >= steps_then + 500, 120,
                   "training to go on with the other actor", run)
        assert len(run.actors()) == 1
        run.ctrl_c()
        summary = _assert_stopped_cleanly(run, run_dir, learners=1)
        assert summary["actor_restarts"] == 1
        assert summary["actors_given_up"] == 1


# CartPole whose reset fails in the actors (processes named actor-N) and works in the learners.
_ACTOR_BREAKS = '''import multiprocessing

import gymnasium as gym
from gymnasium.envs.classic_control.cartpole import CartPoleEnv


class ActorBreaks(CartPoleEnv):
    def reset(self, *, seed=None, options=None):
        if multiprocessing.current_process().name.startswith("actor-"):
            raise RuntimeError("ActorBreaks-v0 cannot start in an actor")
        return super().reset(seed=seed, options=options)


gym.register("ActorBreaks-v0", entry_point=ActorBreaks, max_episode_steps=50)
'''


@pytest.mark.timeout(300)
def test_a_run_whose_actors_all_gave_up_stops_saves_and_says_why(tmp_path: Path) -> None:
    """Every actor of both ranks dies at its start, is restarted once, dies again: the
    run stops at once (it trained on its replay until --max-minutes before), saves a
    complete checkpoint, and ends with one line saying why and what to run, exit 2."""
    (tmp_path / "actor_breaks.py").write_text(_ACTOR_BREAKS)
    run_dir = tmp_path / "run"
    args = _train_args(run_dir, "--env-id", "ActorBreaks-v0", "--env-import", "actor_breaks",
                       "--learners", "2", "--actors", "2", "--max-actor-restarts", "1", *UNBOUNDED)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    with TrainRun(args, tmp_path, env={"PYTHONPATH": path}) as run:
        assert run.wait(START_S) == 2, run.explain()  # the old code ran to --max-minutes 4
        assert run.leftovers() == [], run.explain()
        last = run.stderr().strip().splitlines()[-1]
        assert last.startswith("shardreplay train: every actor gave up (2 died after 2 restarts"), \
            run.explain()
        assert f"--run-dir {run_dir} --auto-resume" in last and "--remote-actors N" in last
        assert run.stdout().strip().splitlines()[-1].startswith("Stopped: every actor gave up (not solved)")
        summary = run.summary()
    assert (summary["stopped_by"], summary["actors_given_up"], summary["actor_restarts"]) == ("actors", 2, 2)
    directory, manifest = newest_checkpoint(run_dir)
    assert Path(summary["checkpoint"]) == directory and manifest.num_shards == 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("env_id", "message"), [
    ("NoSuchEnv-v0", "unknown gymnasium environment 'NoSuchEnv-v0'"),
    ("Pendulum-v1", "needs a Discrete one"),
])
def test_bad_environment_is_a_clear_error_with_exit_2(tmp_path: Path, env_id: str, message: str) -> None:
    run_dir = tmp_path / "run"
    with TrainRun(_train_args(run_dir, "--env-id", env_id, "--learners", "2"), tmp_path) as run:
        assert run.wait(90) == 2, run.explain()
        assert message in run.stderr(), run.explain()
        assert "Traceback" not in run.stderr(), run.explain()
        assert run.seen == {}  # refused before any process started
        assert run.leftovers() == []
