"""A run's policies: ``best/`` kept through a collapse, ``shardreplay export`` and
``evaluate`` on a synthetic run directory (no ``train`` launch), and the loader."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from shardreplay import checkpoint
from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.cli.main import main
from shardreplay.errors import CheckpointFormatError, ConfigError
from shardreplay.runtime.networks import make_q_network
from shardreplay.runtime.policy_file import (
    POLICY_FORMAT,
    best_path,
    best_return,
    keep_if_best,
    load_policy,
    policy_metadata,
    policy_of_run,
    save_policy,
)
from shardreplay.runtime.settings import TrainSettings
from tests.runtime.runtime_helpers import CARTPOLE_SPEC

SETTINGS = TrainSettings.from_dict(dict(hidden=[16, 8], transport="file:///unused"))
OBS = torch.randn(5, 4)


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return make_q_network((4,), 2, "auto", (16, 8))


def test_best_survives_a_collapse_and_a_restart(tmp_path: Path) -> None:
    """Evaluations 10, 500, 9 (a run that passed, then collapsed): best/ holds the 500 one."""
    nets = [_net(s) for s in range(3)]
    best = -math.inf
    for update, (net, ret) in enumerate(zip(nets, [10.0, 500.0, 9.0], strict=True)):
        meta = policy_metadata(SETTINGS, (4,), 2, updates=(update + 1) * 100)
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
    save_policy(tmp_path / "p.safetensors", net, policy_metadata(SETTINGS, (4,), 2))
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


def _run_dir(tmp_path: Path, nets: dict[int, torch.nn.Module]) -> Path:
    """A run directory with a complete checkpoint per ``nets`` entry (id -> online network)."""
    run = tmp_path / "run"
    buffer = ReplayBuffer(CARTPOLE_SPEC, num_streams=1, stream_capacity=8, window=2)
    for cid, net in nets.items():
        data = io.BytesIO()
        torch.save({"agent": {"online": net.state_dict()}}, data)
        checkpoint.save(buffer, run / "checkpoints", cid, files={"learner_state.pt": data.getvalue()},
                        extra={"settings": SETTINGS.to_dict(),
                               "counters": {"updates": cid, "env_steps": 7 * cid}})
    (run / "config.json").write_text(json.dumps(SETTINGS.to_dict()))
    return run


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, (json.loads(out.out) if code == 0 else {"err": out.err})


def test_export_and_evaluate_take_best_latest_or_an_id(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    nets = {10: _net(1), 20: _net(2)}
    run = _run_dir(tmp_path, nets)
    assert torch.equal(policy_of_run(run, "latest").net(OBS), nets[20](OBS))
    assert torch.equal(policy_of_run(run, "10").net(OBS), nets[10](OBS))
    with pytest.raises(ConfigError, match="no best policy"):
        policy_of_run(run, "best")

    code, out = _cli(capsys, "export", str(run), "--out", str(tmp_path / "x.safetensors"))
    assert code == 0 and out["which"] == "latest" and out["updates"] == "20"  # no best yet: latest
    assert torch.equal(load_policy(tmp_path / "x.safetensors").net(OBS), nets[20](OBS))

    keep_if_best(run, nets[10], policy_metadata(SETTINGS, (4,), 2, updates=10), 42.0, -math.inf)
    code, out = _cli(capsys, "export", str(run), "--out", str(tmp_path / "b.safetensors"))
    assert code == 0 and out["which"] == "best" and out["eval_return"] == "42.0"
    assert torch.equal(load_policy(tmp_path / "b.safetensors").net(OBS), nets[10](OBS))

    code, out = _cli(capsys, "evaluate", str(run), "--which", "20", "--episodes", "2")
    assert code == 0 and out["which"] == "20" and len(out["returns"]) == 2
    assert out["mean_return"] == pytest.approx(np.mean(out["returns"])) and out["mean_return"] >= 1

    code, out = _cli(capsys, "evaluate", str(run), "--which", "30")
    assert code == 2 and "no checkpoint 30" in out["err"]


def test_a_policy_of_another_algorithm_is_named_not_rebuilt_as_a_q_network(tmp_path: Path) -> None:
    sac = TrainSettings.from_dict({"algo": "sac", "env_id": "Pendulum-v1"})
    meta = policy_metadata(sac, (3,), 0, updates=10)
    assert meta["algo"] == "sac" and policy_metadata(SETTINGS, (4,), 2)["algo"] == "dqn"
    path = tmp_path / "sac.safetensors"
    save_policy(path, torch.nn.Linear(3, 2), meta)
    with pytest.raises(CheckpointFormatError, match="--algo sac: only DQN's Q-networks are rebuilt"):
        load_policy(path)
