"""Prioritized n-step replay on CartPole, end to end, in a few seconds.

What it does:

1. runs ``num_envs`` CartPole-v1 envs (a gymnasium vector env) with a random policy and
   writes every step into a prioritized :class:`shardreplay.ReplayBuffer`, one stream per
   env, converting gymnasium's ``terminated`` / ``truncated`` and autoreset into dm_env
   step types with :class:`shardreplay.gym.steps.GymStepConverter`;
2. samples windows of ``n + 1`` steps, turns them into n-step transitions with
   :func:`shardreplay.buffer.nstep.nstep_transitions`, and computes TD errors against a
   fixed random linear value function (a stand-in for a learner);
3. feeds ``|TD error|`` back as priorities and prints what the buffer did.

Run: ``python examples/prioritized_cartpole.py`` (``--help`` lists the settings).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

from shardreplay import Field, ReplayBuffer, Spec
from shardreplay.buffer.nstep import Transitions, nstep_transitions
from shardreplay.gym.steps import GymStepConverter


@dataclass(frozen=True)
class Settings:
    """Settings of the demo (each is also a command-line flag, e.g. ``--num-envs 4``)."""

    num_envs: int = 8
    """CartPole envs in the vector env, one buffer stream each."""
    env_steps: int = 4000
    """Steps to collect, over all envs."""
    stream_capacity: int = 256
    """Steps kept per stream (the buffer holds num_envs * stream_capacity steps)."""
    n_step: int = 3
    """n of the n-step return; windows hold n + 1 steps."""
    gamma: float = 0.99
    """Discount factor."""
    batch_size: int = 64
    """Windows per sampled batch."""
    num_batches: int = 20
    """Batches sampled (each followed by a priority update)."""
    alpha: float = 0.6
    """Prioritization exponent: P(i) ~ p_i^alpha."""
    beta: float = 0.4
    """Importance-weight exponent."""
    seed: int = 0
    """Seeds the envs, the random policy, the buffer's sampler and the value function."""


def parse_settings(argv: list[str] | None = None) -> Settings:
    """Settings from command-line flags (defaults from :class:`Settings`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(Settings):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    return Settings(**vars(parser.parse_args(argv)))


def collect(settings: Settings) -> tuple[ReplayBuffer, GymStepConverter, float]:
    """Fill a prioritized buffer from a random policy; returns it, the converter and seconds taken."""
    envs = gym.make_vec("CartPole-v1", num_envs=settings.num_envs, vectorization_mode="sync")
    spec = Spec({"obs": Field(envs.single_observation_space.shape, np.float32),
                 "action": Field((), np.int64), "reward": Field((), np.float32)})
    buffer = ReplayBuffer(spec, num_streams=settings.num_envs, stream_capacity=settings.stream_capacity,
                          window=settings.n_step + 1, sampler="prioritized", alpha=settings.alpha,
                          beta=settings.beta, seed=settings.seed)
    converter = GymStepConverter.from_env(envs)
    start = time.perf_counter()
    try:
        envs.action_space.seed(settings.seed)
        obs, _ = envs.reset(seed=settings.seed)
        converter.reset(obs)
        while converter.num_steps < settings.env_steps:
            action = envs.action_space.sample()
            obs, reward, terminated, truncated, info = envs.step(action)
            for step, stream_ids in converter.step(action, obs, reward, terminated, truncated, info):
                buffer.add(step, stream_ids=stream_ids)
    finally:
        envs.close()
    return buffer, converter, time.perf_counter() - start


def td_errors(t: Transitions, w: torch.Tensor) -> torch.Tensor:
    """TD errors of a fixed linear value function ``V(o) = o @ w``: ``R + g_m V(o_m) - V(o_0)``."""
    return t.reward + t.bootstrap_discount * (t.next_obs @ w) - t.obs @ w


def describe(name: str, x: torch.Tensor) -> str:
    """``name min/mean/max`` of a tensor, for the summary."""
    x = x.double()
    return f"{name:<20} min {x.min().item():9.4f}  mean {x.mean().item():9.4f}  max {x.max().item():9.4f}"


def main(argv: list[str] | None = None) -> None:
    """Run the demo and print its summary."""
    settings = parse_settings(argv)
    buffer, converter, seconds = collect(settings)
    print(f"collected   {converter.num_steps} steps, {converter.num_episodes} episodes from "
          f"{settings.num_envs} CartPole envs in {seconds:.2f} s (random policy)")
    print(f"buffer      {buffer!r}")
    print(f"len         {len(buffer)} valid windows of {buffer.window} steps")
    print(f"num_steps   {buffer.num_steps} stored of capacity {buffer.capacity}")

    w = torch.from_numpy(np.random.default_rng(settings.seed).normal(size=4).astype(np.float32))
    first = buffer.sample(settings.batch_size)
    print("batch       " + ", ".join(f"{k} {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
                                      for k, v in sorted(first.data.items())))
    print(f"            mask {tuple(first.mask.shape)}: {int((~first.mask).sum())} padding positions "
          f"(windows ending at a LAST)")
    print(describe("weights (first)", first.weights))

    updated = 0
    batch = first
    for _ in range(settings.num_batches):
        batch = buffer.sample(settings.batch_size)
        t = nstep_transitions(batch, settings.gamma)
        priorities = td_errors(t, w).abs() + 1e-3
        updated += buffer.update_priorities(batch.keys, priorities.numpy())
    print(f"priorities  {updated} updated over {settings.num_batches} batches, "
          f"{buffer.info().stale_updates} stale (overwritten since sampled)")
    t = nstep_transitions(batch, settings.gamma)
    print(describe("weights (last)", batch.weights))
    print(describe(f"{settings.n_step}-step returns", t.reward))
    print(describe("bootstrap discount", t.bootstrap_discount))
    counts = torch.bincount(t.num_steps, minlength=settings.n_step + 1)[1:].tolist()
    terminal = int((t.bootstrap_discount == 0).sum())
    print(f"n-step      rewards summed per window (1..{settings.n_step}): {counts}; "
          f"{terminal} windows end in a termination (bootstrap 0)")
    print("done")


if __name__ == "__main__":
    main()
