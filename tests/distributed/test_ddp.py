"""DDP with a sharded replay on the training module: the example end to end, and the contract.

(a) ``examples/ddp_dqn.py`` under torchrun (2 gloo ranks) with a tiny budget: exit 0,
    sound figures, no process left behind.
(b) In gloo ranks: the ShardedReplayBuffer kept as ``agent.replay`` never shows up in
    ``named_buffers()`` or ``state_dict()``, and the first DDP forward/backward with
    ``broadcast_buffers=True`` syncs (buffers from rank 0, equal gradients).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import psutil
import pytest
import torch

from tests.support import child_env, run_ranks, torchrun

pytestmark = pytest.mark.distributed

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp_dqn.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ddp_dqn_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# -- (a) the example under torchrun -----------------------------------------------------------
def _run_torchrun(args: list[str], log: Path, timeout_s: float) -> tuple[int, str, set[int]]:
    """Run torchrun in its own session; return (exit code, output, every pid seen under it)."""
    env = child_env()
    cmd = torchrun(2, str(EXAMPLE), *args)
    with open(log, "wb") as sink:  # a file, not a pipe: a full pipe would block the ranks
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    seen: set[int] = {proc.pid}
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.NoSuchProcess):
                seen |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
            time.sleep(0.2)
    finally:
        if proc.poll() is None:  # timed out (or the test was interrupted): kill the whole session
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"torchrun did not finish in {timeout_s} s:\n{log.read_text()}")
    return proc.returncode, log.read_text(), seen


def _alive(pids: set[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.parametrize(("mode", "prefetch", "pipeline"), [
    ("exact", 1, True), pytest.param("exact", 1, False, marks=pytest.mark.slow),
    pytest.param("exact", 4, True, marks=pytest.mark.slow),
    pytest.param("local", 1, True, marks=pytest.mark.slow)])
def test_example_runs_under_torchrun_and_leaves_no_process(tmp_path: Path, mode: str, prefetch: int,
                                                           pipeline: bool) -> None:
    summary_path = tmp_path / "summary.json"
    code, out, pids = _run_torchrun(
        ["--steps", "150", "--learning-starts", "64", "--num-envs", "2", "--batch-size", "16",
         "--stream-capacity", "256", "--log-every", "50", "--mode", mode, "--timeout-s", "30",
         "--prefetch", str(prefetch), "--pipeline" if pipeline else "--no-pipeline",
         "--summary", str(summary_path)],
        tmp_path / "torchrun.log", timeout_s=240)
    assert code == 0, out
    assert out.rstrip().endswith("done"), out
    assert len(pids) >= 3, pids  # torchrun plus its two ranks were seen
    time.sleep(0.5)
    assert not _alive(pids), f"processes left behind: {_alive(pids)}"
    leftovers = [p.pid for p in psutil.process_iter(["cmdline"])
                 if str(summary_path) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers

    s = json.loads(summary_path.read_text())
    assert s["world_size"] == 2 and s["mode"] == mode
    assert 0 < s["train_steps"] < 150  # training started once the global buffer held 64 windows
    # Every sampled key's priority came back: applied on its owner, or counted there as stale.
    assert s["priority_updates_applied"] + s["stale_updates"] == 2 * s["train_steps"] * 16
    assert s["invalid_keys"] == 0
    assert s["replay_steps"] == 2 * 2 * 150 and s["replay_capacity"] == 2 * 2 * 256
    assert s["module_buffers"] == ["online.obs_scale"]
    assert not [k for k in s["state_dict_keys"] if "replay" in k]


# -- (b) the DDP contract, in gloo ranks --------------------------------------------------------
def _ddp_contract(rank: int, world: int) -> dict:
    import torch.distributed as dist

    ex = _example()
    # Strict sampling: every update has landed on its owner when update_priorities returns.
    settings = ex.Settings(num_envs=2, stream_capacity=64, batch_size=8, steps=100, pipeline=False)
    agent = ex.DQNAgent(ex.QNetwork(4, 2, 16), ex.make_replay(settings, 4, rank))
    rng = np.random.default_rng(rank)
    for t in range(40):
        agent.replay.add({"obs": rng.normal(size=(2, 4)).astype(np.float32),
                          "action": rng.integers(0, 2, 2), "reward": np.ones(2, np.float32),
                          "step_type": np.full(2, 0 if t == 0 else 1, np.uint8)})
    out = {"buffers": [n for n, _ in agent.named_buffers()], "state_keys": sorted(agent.state_dict()),
           "param_keys": sorted(n for n, _ in agent.named_parameters())}
    ddp = ex.wrap_ddp(agent)
    out["ddp_buffers"] = [n for n, _ in ddp.named_buffers()]
    out["ddp_state_keys"] = sorted(ddp.state_dict())
    if rank == 1:  # a drifted buffer: the next DDP forward must overwrite it with rank 0's
        with torch.no_grad():
            agent.online.obs_scale.mul_(7.0)
    target = ex.QNetwork(4, 2, 16).requires_grad_(False)
    target.load_state_dict(agent.online.state_dict())
    optimizer = torch.optim.SGD(agent.parameters(), lr=0.1)
    batch = agent.replay.sample(8)
    loss, td = ex.train_step(ddp, agent, target, optimizer, batch, 0.99)
    out["applied"] = agent.replay.update_priorities(batch.keys, td + 1e-3)
    grads = torch.cat([p.grad.reshape(-1) for p in agent.parameters()])
    params = torch.cat([p.detach().reshape(-1) for p in agent.parameters()])
    gathered = [torch.empty_like(grads) for _ in range(world)]
    dist.all_gather(gathered, grads)
    out["grads_equal"] = all(torch.equal(g, gathered[0]) for g in gathered)
    gathered = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(gathered, params)
    out["params_equal"] = all(torch.equal(p, gathered[0]) for p in gathered)
    out["obs_scale"] = agent.online.obs_scale.tolist()
    out["loss_finite"] = bool(np.isfinite(loss)) and bool(torch.isfinite(td).all())
    out["nonzero_grad"] = bool(grads.abs().sum() > 0)
    # Exit faster: the interpreter's final collections walk every object torch imported
    # (seconds on a loaded machine); frozen objects are skipped.
    gc.freeze()
    return out


def test_replay_is_no_module_state_and_first_ddp_step_syncs() -> None:
    results = run_ranks(_ddp_contract, 2)
    for r in results:
        assert r["buffers"] == ["online.obs_scale"]
        assert r["state_keys"] == sorted([*r["param_keys"], "online.obs_scale"])
        assert r["ddp_buffers"] == ["module.online.obs_scale"]
        assert not [k for k in r["ddp_state_keys"] if "replay" in k]
        assert r["grads_equal"] and r["params_equal"] and r["loss_finite"] and r["nonzero_grad"]
    # broadcast_buffers=True: rank 1's drifted buffer was replaced by rank 0's on forward.
    assert results[1]["obs_scale"] == results[0]["obs_scale"]
    assert sum(r["applied"] for r in results) == 2 * 8
