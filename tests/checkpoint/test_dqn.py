"""Integration: DQN on CartPole over 3 gloo ranks, checkpoint, resume on 2 and on 4 ranks.

Each rank runs 2 CartPole envs into its shard (GymStepConverter), trains a tiny MLP
under DDP on 2-step transitions (nstep_transitions) sampled exactly from the sharded
prioritized buffer, and feeds |TD| back as priorities. A CheckpointTrigger saves every
150 steps, with the global step in a file of each part (rank 0 also writes the model weights).
The resumed worlds restore the global step and the model, hold exactly the saved
steps with their priorities, and train on.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from torch.nn.parallel import DistributedDataParallel

from shardreplay import Field, ReplayBuffer, Spec, checkpoint
from shardreplay.buffer.nstep import nstep_transitions
from shardreplay.checkpoint import CheckpointTrigger
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.gym.steps import GymStepConverter
from tests.support import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # minutes on 2 cores: 3 worlds of ranks

SPEC = Spec({"obs": Field((4,), np.float32), "action": Field((), np.int64),
             "reward": Field((), np.float32), "uid": Field((), np.int64)})
ENVS, WINDOW, GAMMA, BATCH, WARMUP, INTERVAL, SAVED_AT, MORE = 2, 3, 0.99, 32, 20, 150, 300, 60


def _content(local: ReplayBuffer) -> dict[int, tuple]:
    """uid -> (priority, action, reward, obs..., step_type, discount) of every stored step."""
    a = {k: v.numpy() for k, v in local.state_dict()["arrays"].items()}
    return {int(u): (float(p), int(act), float(r), *map(float, o), int(st), float(d))
            for u, p, act, r, o, st, d in zip(a["field.uid"], a["priority"], a["field.action"],
                                              a["field.reward"], a["field.obs"], a["step_type"],
                                              a["discount"], strict=True)}


def _train(rank: int, world: int, run_dir: str, phase: int, capacity: int, steps: int) -> dict:
    torch.manual_seed(100 * phase + rank)
    root = Path(run_dir)
    local = ReplayBuffer(SPEC, num_streams=ENVS, stream_capacity=capacity, window=WINDOW,
                         sampler="prioritized", alpha=0.6, beta=0.4, seed=10 * phase + rank)
    buf = ShardedReplayBuffer(local, timeout_s=60)
    q = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    out: dict = {}
    start = 0
    if phase > 1:
        report = checkpoint.load(root, buf, checkpoint_id=SAVED_AT, files=("step-0",))
        start = int(report.files["step-0"])
        q.load_state_dict(torch.load(report.directory / "model.pt", weights_only=True))
        out.update(restored=_content(local), restored_step=start, saved_shards=report.saved_shards)
    target = copy.deepcopy(q)
    ddp = DistributedDataParallel(q)
    opt = torch.optim.Adam(q.parameters(), lr=1e-3)
    trigger = CheckpointTrigger(root, interval_steps=INTERVAL, collectives=buf, poll_interval_steps=10)
    saves: list[int] = []

    def save(step: int) -> None:
        if rank == 0:  # the model next to the replay parts (loaded with weights_only)
            checkpoint.checkpoint_dir(root, step).mkdir(parents=True, exist_ok=True)
            torch.save(q.state_dict(), checkpoint.checkpoint_dir(root, step) / "model.pt")
        checkpoint.save(buf, root, step, files={f"step-{rank}": b"%d" % step}, keep_last=None)
        saves.append(step)
        if step == SAVED_AT and phase == 1:
            out["saved"] = _content(local)

    envs = gym.make_vec("CartPole-v1", num_envs=ENVS, vectorization_mode="sync")
    conv = GymStepConverter.from_env(envs)
    uid = (phase * 10 + rank) * 10_000_000
    losses = []
    try:
        obs, _ = envs.reset(seed=1000 * phase + rank)
        conv.reset(obs)
        for g in range(start, start + steps + 1):
            if trigger.maybe_save(g, save) or g == start + steps:
                break
            eps = max(0.05, 1.0 - g / 200)
            with torch.no_grad():
                greedy = q(torch.from_numpy(obs)).argmax(1).numpy()
            explore = np.random.default_rng(uid + g).random(ENVS) < eps
            action = np.where(explore, np.random.default_rng(g).integers(0, 2, ENVS), greedy)
            obs, reward, term, trunc, info = envs.step(action)
            for step, ids in conv.step(action, obs, reward, term, trunc, info):
                n = step["step_type"].shape[0]
                step["uid"] = np.arange(uid, uid + n)
                uid += n
                local.add(step, stream_ids=ids)
            if g - start >= WARMUP:
                losses.append(_learn(buf, ddp, q, target, opt))
                if g % 50 == 0:
                    target.load_state_dict(q.state_dict())
    finally:
        envs.close()
    out.update(final_step=g, saves=saves, losses=losses, num_steps=local.num_steps,
               new_steps=sum(1 for u in _content(local) if u // 10_000_000 == phase * 10 + rank))
    return out


def _learn(buf: ShardedReplayBuffer, ddp: torch.nn.Module, q: torch.nn.Module,
           target: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    batch = buf.sample(BATCH)
    t = nstep_transitions(batch, GAMMA)
    q_sa = ddp(t.obs).gather(1, t.action[:, None]).squeeze(1)
    with torch.no_grad():
        y = t.reward + t.bootstrap_discount * target(t.next_obs).max(1).values
    td = y - q_sa
    loss = (batch.weights * td.pow(2)).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    buf.update_priorities(batch.keys, td.detach().abs().numpy() + 1e-3)
    return float(loss)


def _files_content(root: Path) -> dict[int, tuple]:
    """What checkpoint SAVED_AT holds, read with the safetensors library."""
    out: dict[int, tuple] = {}
    for f in sorted(checkpoint.checkpoint_dir(root, SAVED_AT).glob("*.safetensors")):
        a = load_file(str(f))
        for u, p, act, r, o, st, d in zip(a["field.uid"], a["priority"], a["field.action"],
                                          a["field.reward"], a["field.obs"], a["step_type"],
                                          a["discount"], strict=True):
            out[int(u)] = (float(p), int(act), float(r), *map(float, o), int(st), float(d))
    return out


def test_dqn_three_ranks_resumes_on_two_and_on_four(tmp_path: Path) -> None:
    first = run_ranks(_train, 3, str(tmp_path), 1, 200, SAVED_AT, timeout_s=300)
    for r in first:
        assert r["saves"] == [INTERVAL, SAVED_AT] and r["final_step"] == SAVED_AT
        assert r["losses"] and all(math.isfinite(x) for x in r["losses"])
    directory = checkpoint.checkpoint_dir(tmp_path, SAVED_AT)
    assert checkpoint.load_manifest(directory).num_shards == 3
    assert [(directory / f"step-{k}").read_bytes() for k in range(3)] == [b"%d" % SAVED_AT] * 3
    saved_live = {u: v for r in first for u, v in r["saved"].items()}
    on_disk = _files_content(tmp_path)
    assert len(on_disk) == len(saved_live) == 3 * ENVS * 200  # full rings
    # Priorities and data exactly as in the buffers at save time; step types as sealed.
    assert {u: v[:-2] for u, v in on_disk.items()} == {u: v[:-2] for u, v in saved_live.items()}

    for world, capacity in ((2, 400), (4, 200)):
        resumed = run_ranks(_train, world, str(tmp_path), world, capacity, MORE, timeout_s=300)
        restored = {}
        for r in resumed:
            assert r["restored_step"] == SAVED_AT and r["saved_shards"] == 3
            assert not set(r["restored"]) & set(restored)
            restored.update(r["restored"])
            assert r["final_step"] == SAVED_AT + MORE  # training went on from the saved step
            assert len(r["losses"]) == MORE - WARMUP and all(math.isfinite(x) for x in r["losses"])
            assert r["new_steps"] > 0
        assert restored == on_disk, f"{world} ranks: restored replay differs from the checkpoint"
