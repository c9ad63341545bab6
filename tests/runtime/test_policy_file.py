"""A run's policies: ``best/`` kept through a collapse, ``shardreplay export`` and
``evaluate`` on a synthetic run directory (no ``train`` launch) for DQN, SAC and R2D2, and
the loader.

Cost: about 2 CPU-s (in-process; a few short Pendulum and CartPole episodes).
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from shardreplay import checkpoint
from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.cli.main import main
from shardreplay.errors import CheckpointDamagedError, CheckpointFormatError, ConfigError
from shardreplay.runtime.algos import algorithm
from shardreplay.runtime.algos.base import Agent
from shardreplay.runtime.algos.networks import make_q_network
from shardreplay.runtime.envs import EnvInfo, describe_env
from shardreplay.runtime.policy_file import (
    POLICY_FORMAT,
    LearnerRecord,
    best_path,
    best_return,
    evaluate,
    keep_if_best,
    learner_records,
    load_policy,
    policy_metadata,
    policy_of_run,
    record_file,
    save_policy,
)
from shardreplay.runtime.settings import TrainSettings
from tests.runtime.runtime_helpers import CARTPOLE_SPEC

SETTINGS = TrainSettings.from_dict(dict(hidden=[16, 8], transport="file:///unused"))
CARTPOLE = EnvInfo((4,), np.dtype(np.float32), 2)
OBS = torch.randn(5, 4)


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return make_q_network((4,), 2, "auto", (16, 8))


def test_best_survives_a_collapse_and_a_restart(tmp_path: Path) -> None:
    """Evaluations 10, 500, 9 (a run that passed, then collapsed): best/ holds the 500 one."""
    nets = [_net(s) for s in range(3)]
    best = -math.inf
    for update, (net, ret) in enumerate(zip(nets, [10.0, 500.0, 9.0], strict=True)):
        meta = policy_metadata(SETTINGS, CARTPOLE, updates=(update + 1) * 100)
        kept = keep_if_best(tmp_path, net, meta, ret, best)
        assert kept == (ret > best)
        best = max(best, ret)
    policy = load_policy(best_path(tmp_path))
    assert policy.meta["updates"] == "200" and float(policy.meta["eval_return"]) == 500.0
    assert torch.equal(policy.net(OBS), nets[1](OBS))
    assert best_return(tmp_path) == 500.0  # a resumed run starts from it
    assert not keep_if_best(tmp_path, nets[2], meta, float("nan"), -math.inf)
    assert list((tmp_path / "best").iterdir()) == [best_path(tmp_path)]  # no temporary left


def test_the_loader_rebuilds_the_network_and_refuses_other_files(tmp_path: Path) -> None:
    net = _net(0)
    save_policy(tmp_path / "p.safetensors", net, policy_metadata(SETTINGS, CARTPOLE))
    policy = load_policy(tmp_path / "p.safetensors")
    assert policy.meta["format"] == POLICY_FORMAT and json.loads(policy.meta["hidden"]) == [16, 8]
    assert torch.equal(policy.net(OBS), net(OBS))
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointFormatError, match="not a shardreplay policy"):
        load_policy(tmp_path / "other.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 20)
    with pytest.raises(CheckpointFormatError, match="safetensors"):
        load_policy(tmp_path / "junk.safetensors")


def _run_dir(tmp_path: Path, agents: dict[int, dict], settings: TrainSettings = SETTINGS) -> Path:
    """A run directory with a complete checkpoint per ``agents`` entry (id -> the learner
    state, as the learner saves it)."""
    run = tmp_path / "run"
    buffer = ReplayBuffer(CARTPOLE_SPEC, num_streams=1, stream_capacity=8, window=2)
    for cid, agent in agents.items():
        data = io.BytesIO()
        torch.save({"agent": agent}, data)
        record = LearnerRecord({"updates": cid, "env_steps": 7 * cid}, None, 0.0, settings.to_dict(), None)
        checkpoint.save(buffer, run / "checkpoints", cid,
                        files={"learner_state.pt": data.getvalue(), record_file(0, 1): record.as_bytes()})
    (run / "config.json").write_text(json.dumps(settings.to_dict()))
    return run


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, (json.loads(out.out) if code == 0 else {"err": out.err})


def test_export_and_evaluate_take_best_latest_or_an_id(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    nets = {10: _net(1), 20: _net(2)}
    run = _run_dir(tmp_path, {cid: {"online": net.state_dict()} for cid, net in nets.items()})
    assert torch.equal(policy_of_run(run, "latest").net(OBS), nets[20](OBS))
    assert torch.equal(policy_of_run(run, "10").net(OBS), nets[10](OBS))
    with pytest.raises(ConfigError, match="no best policy"):
        policy_of_run(run, "best")

    code, out = _cli(capsys, "export", str(run), "--out", str(tmp_path / "x.safetensors"))
    assert code == 0 and out["which"] == "latest" and out["updates"] == 20  # no best yet: latest
    assert out["obs_shape"] == [4] and out["hidden"] == [16, 8] and out["env_id"] == "CartPole-v1"
    assert torch.equal(load_policy(tmp_path / "x.safetensors").net(OBS), nets[20](OBS))

    keep_if_best(run, nets[10], policy_metadata(SETTINGS, CARTPOLE, updates=10), 42.0, -math.inf)
    code, out = _cli(capsys, "export", str(run), "--out", str(tmp_path / "b.safetensors"))
    assert code == 0 and out["which"] == "best" and out["eval_return"] == 42.0
    assert torch.equal(load_policy(tmp_path / "b.safetensors").net(OBS), nets[10](OBS))

    code, out = _cli(capsys, "evaluate", str(run), "--which", "20", "--episodes", "2")
    assert code == 0 and out["which"] == "20" and len(out["returns"]) == 2
    assert out["mean_return"] == pytest.approx(np.mean(out["returns"])) and out["mean_return"] >= 1

    code, out = _cli(capsys, "evaluate", str(run), "--which", "30")
    assert code == 2 and "no checkpoint 30" in out["err"]
    (checkpoint.checkpoint_dir(run / "checkpoints", 10) / "manifest.json").unlink()
    code, out = _cli(capsys, "evaluate", str(run), "--which", "10")
    assert code == 2 and "manifest.json" in out["err"]  # incomplete: refused, saying why


SAC = TrainSettings.from_dict({"algo": "sac", "env_id": "Pendulum-v1", "hidden": [16, 16],
                               "transport": "file:///unused"})
R2D2 = TrainSettings.from_dict({"algo": "r2d2", "env_id": "shardreplay/MaskedCartPole-v1", "hidden": [8],
                                "transport": "file:///unused"})


def _agent(settings: TrainSettings, seed: int) -> tuple[EnvInfo, Agent]:
    """A fresh learner of ``settings``' algorithm (random networks of ``seed``)."""
    algo = algorithm(settings.learners.algo)
    env = describe_env(settings.run.source, algo.actions)
    torch.manual_seed(seed)
    return env, algo.make_agent(env, settings, world=1)


def _same_actions(a: Callable, b: Callable, obs: torch.Tensor) -> None:
    """Both give the same actions for the steps ``obs[:, t]`` called in turn."""
    with torch.no_grad():
        for t in range(obs.shape[1]):
            np.testing.assert_array_equal(a(obs[:, t]), b(obs[:, t]))


@pytest.mark.parametrize("settings", [SAC, R2D2], ids=["sac", "r2d2"])
def test_export_and_evaluate_rebuild_sac_and_r2d2_policies(settings: TrainSettings, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The latest checkpoint's and the best policy of a SAC or R2D2 run: exported, rebuilt
    (the settings in the metadata), acting as the learner's network, evaluated."""
    algo = algorithm(settings.learners.algo)
    env, first = _agent(settings, 1)
    _env, second = _agent(settings, 2)
    run = _run_dir(tmp_path, {10: first.state_dict(), 20: second.state_dict()}, settings)
    obs = torch.randn(6, 5, *env.obs_shape)
    code, out = _cli(capsys, "export", str(run), "--out", str(tmp_path / "latest.safetensors"))
    assert code == 0 and out["which"] == "latest" and out["algo"] == algo.name and out["updates"] == 20
    policy = load_policy(tmp_path / "latest.safetensors")
    assert type(policy.net) is type(second.module) and policy.algo == algo.name
    _same_actions(policy.greedy(), algo.greedy(second.module), obs)
    # numpy observations, as docs/train.md shows them, act the same (issue 40)
    np.testing.assert_array_equal(policy.greedy()(obs[:, 0].numpy()), policy.greedy()(obs[:, 0]))

    meta = policy_metadata(settings, env, updates=10)
    keep_if_best(run, first.module, meta, -5.0, -math.inf)
    code, out = _cli(capsys, "evaluate", str(run), "--episodes", "2", "--seed", "4")
    assert code == 0 and out["which"] == "best" and out["algo"] == algo.name and out["updates"] == 10
    assert out["returns"] == evaluate(algo.greedy(first.module), settings.run.source, 2, seed=4)
    _same_actions(policy_of_run(run, "best").greedy(), algo.greedy(first.module), obs)


def test_sac_evaluates_its_squashed_mean(tmp_path: Path) -> None:
    """SAC's evaluation action is ``bias + scale * tanh(mean)`` (Pendulum: 2 tanh(mean))."""
    env, agent = _agent(SAC, 3)
    meta = policy_metadata(SAC, env)
    assert json.loads(meta["action_low"]) == [-2.0] and json.loads(meta["action_high"]) == [2.0]
    save_policy(tmp_path / "sac.safetensors", agent.module, meta)
    policy = load_policy(tmp_path / "sac.safetensors")
    obs = torch.randn(7, 3)
    with torch.no_grad():
        want = 2.0 * torch.tanh(agent.module(obs)[0])
        assert np.allclose(policy.greedy()(obs), want.numpy(), atol=1e-6)


def test_the_loader_names_an_unknown_algorithm_and_weights_that_do_not_fit(tmp_path: Path) -> None:
    env, agent = _agent(SAC, 0)
    path = tmp_path / "p.safetensors"
    save_policy(path, agent.module, {**policy_metadata(SAC, env), "algo": "ppo"})
    with pytest.raises(CheckpointFormatError, match="--algo must be one of"):
        load_policy(path)
    save_policy(path, torch.nn.Linear(3, 2), policy_metadata(SAC, env))
    with pytest.raises(CheckpointFormatError, match="do not rebuild the network"):
        load_policy(path)


def test_a_learner_record_is_read_back_typed_and_verified(tmp_path: Path) -> None:
    buffer = ReplayBuffer(CARTPOLE_SPEC, num_streams=1, stream_capacity=8, window=2)
    record = LearnerRecord({"updates": 3, "env_steps": 21}, 4.5, 12.0, SETTINGS.to_dict(),
                           {"stored": {"2": [[0, 4]]}})
    directory = checkpoint.save(buffer, tmp_path, 3, files={record_file(0, 1): record.as_bytes()})
    assert learner_records(checkpoint.load_manifest(directory)) == [record]
    (directory / record_file(0, 1)).write_bytes(record.as_bytes().replace(b"21", b"22"))
    with pytest.raises(CheckpointDamagedError, match="checksum mismatch"):
        learner_records(checkpoint.load_manifest(directory))
