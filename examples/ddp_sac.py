"""SAC on Pendulum over data-parallel ranks, with one global prioritized replay over all ranks.

Every rank steps its own Pendulum-v1 vector env and writes into its own shard (a
prioritized :class:`shardreplay.ReplayBuffer` of n-step windows); a
:class:`shardreplay.ShardedReplayBuffer` over the shards samples the one global
distribution (``--mode exact``) or each rank's own shard, weighted (``--mode local``).
The learner is ``shardreplay``'s SAC (tanh-Gaussian policy, twin critics, learned
temperature): every rank starts from rank 0's networks and averages its gradients with
the other ranks' (one all-reduce per update, as DDP), so every rank takes the same
steps and the same soft (polyak) target update. The run ends by printing each rank's
checksum of its networks, targets and temperature: they must be equal.

Priorities are the mean of the twin critics' ``|TD error|``, sent back to the owning shards.

Run (gloo on CPU, 2 ranks)::

    torchrun --nproc-per-node 2 examples/ddp_sac.py              # --help lists the settings
    torchrun --nproc-per-node 2 examples/ddp_sac.py --steps 300 --learning-starts 100
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist

from shardreplay import Field, LinearSchedule, ReplayBuffer, ShardedReplayBuffer, Spec
from shardreplay.gym.steps import GymStepConverter
from shardreplay.runtime.algos.sac import Sac, SacSettings, SquashedGaussianActor, TwinQ


@dataclass(frozen=True)
class Settings:
    """Settings (each is also a command-line flag, e.g. ``--num-envs 4``)."""

    steps: int = 4000
    """Iterations per rank: one vector-env step each, plus one training step once started."""
    num_envs: int = 2
    """Pendulum envs per rank, one shard stream each."""
    stream_capacity: int = 20_000
    """Steps kept per stream."""
    n_step: int = 1
    """n of the n-step return; windows hold n + 1 steps."""
    gamma: float = 0.99
    """Discount factor."""
    batch_size: int = 128
    """Windows per rank per training step."""
    mode: str = "exact"
    """Global sampling mode: exact or local."""
    lr: float = 1e-3
    """Critics' and temperature's Adam learning rate (the policy's: a third of it)."""
    hidden: int = 128
    """Width of the two hidden layers of policy and critics."""
    alpha: float = 0.6
    """Prioritization exponent."""
    beta_start: float = 0.4
    """Importance-weight exponent at the start, annealed linearly to 1 over the run."""
    learning_starts: int = 1000
    """Train once the global buffer holds this many windows (random actions until then)."""
    log_every: int = 500
    """Iterations between progress lines (rank 0)."""
    timeout_s: float = 60.0
    """How long a replay collective waits for the other ranks."""
    seed: int = 0
    """Base seed (each rank adds its rank)."""
    summary: str = ""
    """Write a JSON summary of the run to this file (rank 0), if given."""


def parse_settings(argv: list[str] | None = None) -> Settings:
    """Settings from command-line flags (defaults from :class:`Settings`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(Settings):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    settings = Settings(**vars(parser.parse_args(argv)))
    if settings.mode not in ("exact", "local"):
        parser.error("--mode must be exact or local")
    return settings


def make_replay(settings: Settings, obs_dim: int, act_dim: int, rank: int) -> ShardedReplayBuffer:
    """This rank's prioritized shard of n-step windows, inside the global sharded buffer."""
    spec = Spec({"obs": Field((obs_dim,), np.float32), "action": Field((act_dim,), np.float32),
                 "reward": Field((), np.float32)})
    beta = LinearSchedule(settings.beta_start, 1.0, max(1, settings.steps))
    local = ReplayBuffer(spec, num_streams=settings.num_envs, stream_capacity=settings.stream_capacity,
                         window=settings.n_step + 1, sampler="prioritized", alpha=settings.alpha,
                         beta=beta, seed=settings.seed + rank)
    return ShardedReplayBuffer(local, timeout_s=settings.timeout_s, mode=settings.mode)


def checksum(agent: Sac) -> str:
    """SHA-256 of the policy, critics, target critics and temperature."""
    h = hashlib.sha256()
    for module in (agent.actor, agent.critic, agent.critic_target):
        for t in module.state_dict().values():
            h.update(t.detach().numpy().tobytes())
    h.update(agent.log_alpha.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def global_mean(values: list[float], last: int = 10) -> float:
    """Mean of every rank's last ``last`` values (a collective)."""
    tail = values[-last:]
    t = torch.tensor([len(tail), sum(tail)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[1] / max(t[0], 1))


def run(settings: Settings) -> dict:
    """Train on this rank (torch.distributed must be initialised); returns the summary."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(settings.seed + rank)  # rank 0's networks win the broadcast anyway
    envs = gym.make_vec("Pendulum-v1", num_envs=settings.num_envs, vectorization_mode="sync")
    try:
        return _train(settings, envs, rank, world)
    finally:
        envs.close()


def _train(settings: Settings, envs: gym.vector.VectorEnv, rank: int, world: int) -> dict:
    obs_space, act_space = envs.single_observation_space, envs.single_action_space
    obs_dim, act_dim = int(obs_space.shape[0]), int(act_space.shape[0])
    replay = make_replay(settings, obs_dim, act_dim, rank)
    hidden = (settings.hidden, settings.hidden)
    agent = Sac(SquashedGaussianActor(obs_dim, act_space.low.tolist(), act_space.high.tolist(), hidden),
                TwinQ(obs_dim, act_dim, hidden),
                SacSettings(gamma=settings.gamma, actor_lr=settings.lr / 3, critic_lr=settings.lr,
                            alpha_lr=settings.lr), world=world)
    rng = np.random.default_rng([settings.seed, rank])
    converter = GymStepConverter.from_env(envs)
    obs, _ = envs.reset(seed=settings.seed + 1000 * rank)
    converter.reset(obs)
    running, returns, losses = np.zeros(settings.num_envs), [], []
    started, start = False, time.perf_counter()
    for it in range(settings.steps):
        if started:
            with torch.no_grad():
                action = agent.actor.sample(torch.as_tensor(obs, dtype=torch.float32))[0].numpy()
        else:
            shape = (settings.num_envs, act_dim)
            action = rng.uniform(act_space.low, act_space.high, shape).astype(np.float32)
        obs, reward, terminated, truncated, info = envs.step(action)
        running += reward
        done = terminated | truncated
        returns += running[done].tolist()
        running[done] = 0.0
        for step, stream_ids in converter.step(action, obs, reward, terminated, truncated, info):
            replay.add(step, stream_ids=stream_ids)
        # len() is collective: every rank sees the same global count and starts together.
        started = started or len(replay) >= settings.learning_starts
        if started:
            batch = replay.sample(settings.batch_size)
            priorities, loss = agent.learn(batch)
            replay.update_priorities(batch.keys, priorities)
            losses.append(loss)
        if (it + 1) % settings.log_every == 0 or it + 1 == settings.steps:
            mean_return = global_mean(returns)
            if rank == 0:
                print(f"iter {it + 1:6d}  return(last 10/rank) {mean_return:8.1f}  alpha {agent.alpha:.3f}  "
                      f"updates {agent.updates}  {time.perf_counter() - start:6.1f} s", flush=True)
    replay.flush_updates()
    sums: list[str | None] = [None] * world
    dist.all_gather_object(sums, checksum(agent))
    length, steps, _capacity = replay.global_sizes()
    summary = {"world_size": world, "mode": settings.mode, "iterations": settings.steps,
               "updates": agent.updates, "replay_len": length, "replay_steps": steps,
               "episodes_rank": len(returns), "mean_return_last10": global_mean(returns),
               "alpha": agent.alpha, "checksums": sums, "seconds": round(time.perf_counter() - start, 2)}
    replay.close()
    return summary


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
    # As examples/ddp_dqn.py: leave without interpreter teardown (gloo's threads may still
    # hold the GIL-needing tensors of the last collective; pytorch/pytorch#190489).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
