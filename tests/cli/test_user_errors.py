"""Errors a user meets outside ``train`` (issue 40, items 6 and 7): each names the fix, in
one line, and the commands take what a user naturally gives them."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import gymnasium as gym
import pytest

from shardreplay import checkpoint
from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.cli.main import build_parser, main
from shardreplay.errors import ConfigError
from shardreplay.runtime.algos.networks import make_q_network
from shardreplay.runtime.envs import describe_env, env_source
from shardreplay.runtime.policy_file import keep_if_best, policy_metadata
from shardreplay.runtime.settings import TrainSettings
from tests.runtime.runtime_helpers import CARTPOLE_SPEC

_MODULE = "shardreplay_cwd_env"
_ENV_ID = "ShardreplayCwd-v0"


@pytest.fixture
def module_in_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module that registers an env, in the current directory, which is not on sys.path
    (as under the ``shardreplay`` console script); unregistered and forgotten after."""
    entry = "gymnasium.envs.classic_control:CartPoleEnv"
    source = f"import gymnasium as gym\ngym.register({_ENV_ID!r}, entry_point={entry!r})\n"
    (tmp_path / f"{_MODULE}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    try:
        yield _MODULE
    finally:
        sys.modules.pop(_MODULE, None)
        gym.registry.pop(_ENV_ID, None)


def test_an_env_import_module_in_the_current_directory_is_found(module_in_cwd: str) -> None:
    info = describe_env(env_source(_ENV_ID, module_in_cwd))
    assert (info.obs_shape, info.num_actions) == ((4,), 2)
    with pytest.raises(ConfigError, match=r"not on sys\.path nor in the current directory .*PYTHONPATH"):
        describe_env(env_source(_ENV_ID, "shardreplay_no_such_module"))


def test_evaluate_of_a_run_whose_env_cannot_be_made_here_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = TrainSettings.from_dict({"hidden": [8], "env_import": "shardreplay_no_such_module"})
    env = describe_env(env_source("CartPole-v1"))
    net = make_q_network((4,), 2, "auto", (8,))
    keep_if_best(tmp_path, net, policy_metadata(settings, env, updates=1), 1.0, -math.inf)
    assert main(["evaluate", str(tmp_path), "--episodes", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: cannot import shardreplay_no_such_module"), err


def test_checkpoint_inspect_and_verify_take_the_run_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    buffer = ReplayBuffer(CARTPOLE_SPEC, num_streams=1, stream_capacity=8, window=2)
    checkpoint.save(buffer, tmp_path / "run" / "checkpoints", 3)
    assert main(["checkpoint", "inspect", str(tmp_path / "run"), "--json", "--no-priorities"]) == 0
    assert json.loads(capsys.readouterr().out)["newest_complete"] == 3
    assert main(["checkpoint", "verify", str(tmp_path / "run")]) == 0
    assert "OK " in capsys.readouterr().out


def _help(command: str) -> str:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return " ".join(sub.choices[command].format_help().split())


def test_help_texts_say_what_a_user_needs(capsys: pytest.CaptureFixture[str]) -> None:
    assert "dqn, sac (Box actions) or r2d2" in _help("actor")  # the agreed settings: train's texts
    for command in ("checkpoint", "evaluate", "export", "train", "actor"):
        assert "``" not in _help(command), command
    assert "the final checkpoint and evaluation come after it" in _help("train")  # --max-minutes
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--bogus"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: shardreplay train ") and "unrecognized arguments: --bogus" in err, err


@pytest.mark.parametrize("extra", [["--jobs", "0"], ["--from", "rollouts", "--jobs", "2"]])
def test_export_refuses_jobs_it_cannot_use_before_reading_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    # tmp_path is no run directory: the refusal must come before anything is read from it.
    assert main(["export", str(tmp_path), "--minari", "sr/x-v0", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --jobs"), err
