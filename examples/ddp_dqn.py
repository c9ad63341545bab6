"""Double DQN on CartPole under DDP, with one global prioritized replay over all ranks.

Every rank steps its own CartPole-v1 vector env and writes into its own shard (a
prioritized :class:`shardreplay.ReplayBuffer` of n-step windows). A
:class:`shardreplay.ShardedReplayBuffer` over the shards is an attribute of the training
module (``agent.replay``); it is not an ``nn.Module`` and holds no tensors, so DDP's
buffer broadcast (``broadcast_buffers=True``) never sees replay data. Each training step
samples the global prioritized distribution (``--mode exact``: items fetched from the
ranks that own them; ``--mode local``: each rank samples its own shard with the shard
factor in the weights), trains with the importance-weighted double-DQN loss on n-step
targets, and sends ``|TD error|`` back to the owning shards.

Every decision that leads into a collective (start training? log now?) is taken
collectively or on the iteration counter that all ranks share, so ranks never wait on
each other forever; a missing rank gives ``CollectiveTimeout`` after ``--timeout-s``.

Run (gloo on CPU, 2 ranks)::

    torchrun --nproc-per-node 2 examples/ddp_dqn.py            # --help lists the settings
    torchrun --nproc-per-node 2 examples/ddp_dqn.py --steps 300 --learning-starts 100
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardreplay import Batch, Field, LinearSchedule, ReplayBuffer, ShardedReplayBuffer, Spec
from shardreplay.buffer.nstep import nstep_transitions
from shardreplay.gym.steps import GymStepConverter

OBS_SCALE = (2.4, 3.0, 0.21, 3.0)  # CartPole's typical magnitudes


@dataclass(frozen=True)
class Settings:
    """Settings (each is also a command-line flag, e.g. ``--num-envs 4``)."""

    steps: int = 3000
    """Iterations per rank: one vector-env step each, plus one training step once started."""
    num_envs: int = 4
    """CartPole envs per rank, one shard stream each."""
    stream_capacity: int = 2048
    """Steps kept per stream."""
    n_step: int = 3
    """n of the n-step return; windows hold n + 1 steps."""
    gamma: float = 0.99
    """Discount factor."""
    batch_size: int = 64
    """Windows per rank per training step."""
    mode: str = "exact"
    """Global sampling mode: exact or local."""
    lr: float = 1e-3
    """Adam learning rate."""
    hidden: int = 64
    """Width of the Q-network's two hidden layers."""
    alpha: float = 0.6
    """Prioritization exponent."""
    beta_start: float = 0.4
    """Importance-weight exponent at the start, annealed linearly to 1 over the run."""
    learning_starts: int = 500
    """Train once the global buffer holds this many valid windows."""
    target_update: int = 100
    """Training steps between target-network copies."""
    eps_end: float = 0.05
    """Final exploration rate (linear from 1 over the first half of the run)."""
    log_every: int = 500
    """Iterations between progress lines (rank 0)."""
    timeout_s: float = 60.0
    """How long a replay collective waits for the other ranks."""
    prefetch: int = 1
    """Batches drawn per replay exchange (k > 1: 1/k of the collectives, slightly stale)."""
    pipeline: bool = True
    """Draw the next batch on a background thread while this one trains (--no-pipeline: not)."""
    seed: int = 0
    """Base seed (each rank adds its rank)."""
    summary: str = ""
    """Write a JSON summary of the run to this file (rank 0), if given."""


def parse_settings(argv: list[str] | None = None) -> Settings:
    """Settings from command-line flags (defaults from :class:`Settings`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default)
    settings = Settings(**vars(parser.parse_args(argv)))
    if settings.mode not in ("exact", "local"):
        parser.error("--mode must be exact or local")
    return settings


class QNetwork(nn.Module):
    """An MLP over scaled observations; the scale is a module buffer DDP broadcasts."""

    def __init__(self, obs_dim: int, num_actions: int, hidden: int) -> None:
        super().__init__()
        self.register_buffer("obs_scale", 1.0 / torch.tensor(OBS_SCALE[:obs_dim] + (1.0,) * (obs_dim - 4)))
        self.mlp = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, num_actions))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """Q-values ``[B, num_actions]``."""
        return self.mlp(obs * self.obs_scale)


class DQNAgent(nn.Module):
    """The training module: the online Q-network, plus the global replay as a plain attribute.

    Args:
        online: the online Q-network.
        replay: the sharded replay; stored as an ordinary attribute, it is not part of
            ``parameters()``, ``named_buffers()`` or ``state_dict()``.
    """

    def __init__(self, online: QNetwork, replay: ShardedReplayBuffer) -> None:
        super().__init__()
        self.online = online
        self.replay = replay

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """Q-values of the online network."""
        return self.online(obs)


def make_replay(settings: Settings, obs_dim: int, rank: int) -> ShardedReplayBuffer:
    """This rank's prioritized shard of n-step windows, inside the global sharded buffer."""
    spec = Spec({"obs": Field((obs_dim,), np.float32), "action": Field((), np.int64),
                 "reward": Field((), np.float32)})
    beta = LinearSchedule(settings.beta_start, 1.0, max(1, settings.steps))
    local = ReplayBuffer(spec, num_streams=settings.num_envs, stream_capacity=settings.stream_capacity,
                         window=settings.n_step + 1, sampler="prioritized", alpha=settings.alpha,
                         beta=beta, seed=settings.seed + rank)
    return ShardedReplayBuffer(local, timeout_s=settings.timeout_s, prefetch=settings.prefetch,
                               pipeline=settings.pipeline, mode=settings.mode)


def wrap_ddp(agent: DQNAgent) -> DDP:
    """DDP over the agent, broadcasting rank 0's module buffers on every forward.

    ``broadcast_buffers`` is the name every torch >= 2.3 accepts; torch 2.13 renamed it
    ``forward_sync_buffers`` and warns about the old name, which we silence here.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        return DDP(agent, broadcast_buffers=True)


def train_step(ddp: DDP, agent: DQNAgent, target: QNetwork, optimizer: torch.optim.Optimizer,
               batch: Batch, gamma: float) -> tuple[float, torch.Tensor]:
    """One importance-weighted double-DQN step on n-step targets; returns (loss, |TD|).

    The forward through ``ddp`` (broadcasting module buffers) and the backward (the
    gradient all-reduce) are collective: every rank calls this once per training step.
    """
    t = nstep_transitions(batch, gamma)
    q = ddp(t.obs).gather(1, t.action[:, None]).squeeze(1)
    with torch.no_grad():
        next_action = agent(t.next_obs).argmax(dim=1, keepdim=True)  # online picks
        next_q = target(t.next_obs).gather(1, next_action).squeeze(1)  # target rates
        y = t.reward + t.bootstrap_discount * next_q
    loss = (batch.weights * F.smooth_l1_loss(q, y, reduction="none")).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach()), (y - q).detach().abs()


class Episodes:
    """Returns of finished episodes of one rank's vector env."""

    def __init__(self, num_envs: int) -> None:
        self.running = np.zeros(num_envs)
        self.returns: list[float] = []

    def step(self, reward: np.ndarray, done: np.ndarray) -> None:
        """Add a vector step's rewards; close the episodes that ended."""
        self.running += reward
        self.returns += self.running[done].tolist()
        self.running[done] = 0.0


def act(agent: DQNAgent, obs: np.ndarray, eps: float, num_actions: int,
        rng: np.random.Generator) -> np.ndarray:
    """Epsilon-greedy actions of the online network (no DDP call: nothing collective)."""
    with torch.no_grad():
        greedy = agent(torch.from_numpy(np.asarray(obs, np.float32))).argmax(dim=1).numpy()
    explore = rng.random(len(greedy)) < eps
    return np.where(explore, rng.integers(0, num_actions, len(greedy)), greedy)


def global_stats(values: list[float], extra: list[float]) -> np.ndarray:
    """All-reduce ``[count, sum, sum of the last 20] + extra`` over ranks (collective)."""
    last = values[-20:]
    t = torch.tensor([len(values), sum(values), len(last), sum(last), *extra], dtype=torch.float64)
    dist.all_reduce(t)
    return t.numpy()


def run(settings: Settings) -> dict:
    """Train on this rank (torch.distributed must be initialised); returns rank 0's summary."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(settings.seed)  # same initial network everywhere (DDP broadcasts it anyway)
    envs = gym.make_vec("CartPole-v1", num_envs=settings.num_envs, vectorization_mode="sync")
    try:
        return _train(settings, envs, rank, world)
    finally:
        envs.close()


def _train(settings: Settings, envs: gym.vector.VectorEnv, rank: int, world: int) -> dict:
    obs_dim, num_actions = envs.single_observation_space.shape[0], int(envs.single_action_space.n)
    agent = DQNAgent(QNetwork(obs_dim, num_actions, settings.hidden), make_replay(settings, obs_dim, rank))
    ddp = wrap_ddp(agent)  # from here on, every rank acts with rank 0's weights
    target = copy.deepcopy(agent.online).requires_grad_(False)
    optimizer = torch.optim.Adam(agent.parameters(), lr=settings.lr)
    rng = np.random.default_rng([settings.seed, rank])
    converter = GymStepConverter.from_env(envs)
    obs, _ = envs.reset(seed=settings.seed + 1000 * rank)
    converter.reset(obs)
    episodes = Episodes(settings.num_envs)
    started, train_steps, losses = False, 0, []
    start = time.perf_counter()
    for it in range(settings.steps):
        eps = max(settings.eps_end, 1.0 - it / max(1, settings.steps // 2))
        action = act(agent, obs, eps, num_actions, rng)
        obs, reward, terminated, truncated, info = envs.step(action)
        episodes.step(reward, terminated | truncated)
        for step, stream_ids in converter.step(action, obs, reward, terminated, truncated, info):
            agent.replay.add(step, stream_ids=stream_ids)
        # len() is collective: all ranks see the same global count and start together.
        started = started or len(agent.replay) >= settings.learning_starts
        if started:
            batch = agent.replay.sample(settings.batch_size)
            loss, td = train_step(ddp, agent, target, optimizer, batch, settings.gamma)
            agent.replay.update_priorities(batch.keys, td + 1e-3)
            losses.append(loss)
            train_steps += 1
            if train_steps % settings.target_update == 0:
                target.load_state_dict(agent.online.state_dict())
        if (it + 1) % settings.log_every == 0 or it + 1 == settings.steps:
            stats = global_stats(episodes.returns, [float(np.mean(losses[-100:] or [0.0]))])
            if rank == 0:
                print(f"iter {it + 1:6d}  episodes {int(stats[0]):5d}  return(last 20/rank) "
                      f"{stats[3] / max(stats[2], 1):7.1f}  loss {stats[4] / world:.4f}  "
                      f"train steps {train_steps}  {time.perf_counter() - start:6.1f} s", flush=True)
    # With prefetch > 1 or the pipeline, updates for other shards wait for the next
    # exchange: send them now.
    agent.replay.flush_updates()
    summary = _summary(settings, agent, episodes, train_steps, agent.replay.info().updates_applied,
                       time.perf_counter() - start)
    agent.replay.close()  # the pipeline's thread and process group
    return summary


def _summary(settings: Settings, agent: DQNAgent, episodes: Episodes, train_steps: int, applied: int,
             seconds: float) -> dict:
    world = dist.get_world_size()
    length, steps, capacity = agent.replay.global_sizes()
    stats = global_stats(episodes.returns, [applied, agent.replay.local.info().stale_updates,
                                            agent.replay.info().invalid_keys])
    return {"world_size": world, "mode": settings.mode, "iterations": settings.steps,
            "train_steps": train_steps, "batch_size": settings.batch_size,
            "priority_updates_applied": int(stats[4]), "stale_updates": int(stats[5]),
            "invalid_keys": int(stats[6]), "episodes": int(stats[0]),
            "mean_return_last20_per_rank": float(stats[3] / max(stats[2], 1)),
            "replay_len": length, "replay_steps": steps, "replay_capacity": capacity,
            "module_buffers": [name for name, _ in agent.named_buffers()],
            "state_dict_keys": sorted(agent.state_dict()), "seconds": round(seconds, 2)}


def main(argv: list[str] | None = None) -> None:
    """Entry point under torchrun (reads RANK, WORLD_SIZE, MASTER_ADDR/PORT from the env)."""
    settings = parse_settings(argv)
    dist.init_process_group("gloo")
    try:
        summary = run(settings)
        if dist.get_rank() == 0:
            print(json.dumps(summary), flush=True)
            if settings.summary:
                Path(settings.summary).write_text(json.dumps(summary, indent=1))
            print("done", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without interpreter teardown. DDP keeps the process group alive past
    # destroy_process_group (torch 2.13 holds references we cannot drop), so gloo's
    # worker threads still run at exit; one still releasing the tensors of the last
    # collective needs the GIL while the interpreter finalizes and aborts the process
    # ("terminate called without an active exception", SIGABRT; pytorch/pytorch#190489):
    # about 1 run in 5 on a loaded 2-core machine. Everything is flushed and closed here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
