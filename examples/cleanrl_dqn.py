"""CleanRL's dqn.py, ported onto shardreplay (uniform or prioritized replay).

The loop is CleanRL's (``cleanrl/dqn.py``: epsilon-greedy, a 120-84 MLP, a hard target
copy every ``target_network_frequency`` steps, MSE on 1-step TD targets), with its
replay buffer replaced. What changed, line by line, is in docs/porting.md:

* ``GymStepWriter`` writes what ``envs.step`` returned (no ``real_next_obs`` juggling);
* ``rb.sample_transitions(batch_size, gamma=...)`` gives ``reward`` (the n-step return)
  and ``bootstrap_discount`` (gamma^n, 0 after a termination), so the target is
  ``reward + bootstrap_discount * max_a Q_target(next_obs, a)``;
* ``--prioritized`` samples with priorities ``|TD error|`` and weights the loss.

Run: ``python examples/cleanrl_dqn.py`` (``--help`` lists the settings; CleanRL's defaults
take 500,000 steps, ``--total-timesteps 20000 --learning-starts 1000`` takes seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shardreplay import GymStepWriter, ReplayBuffer, spec_from_env


@dataclass(frozen=True)
class Args:
    """CleanRL's settings (each is also a flag, e.g. ``--total-timesteps 20000``)."""

    seed: int = 1
    """Seeds python, numpy, torch, the env and the buffer."""
    env_id: str = "CartPole-v1"
    """The gymnasium environment."""
    total_timesteps: int = 500_000
    """Env steps in all."""
    learning_rate: float = 2.5e-4
    """Adam's learning rate."""
    buffer_size: int = 10_000
    """Replay capacity in steps."""
    gamma: float = 0.99
    """Discount factor."""
    tau: float = 1.0
    """Target network update rate (1: a hard copy)."""
    target_network_frequency: int = 500
    """Env steps between target network updates."""
    batch_size: int = 128
    """Transitions per gradient step."""
    start_e: float = 1.0
    """Starting epsilon."""
    end_e: float = 0.05
    """Final epsilon."""
    exploration_fraction: float = 0.5
    """Fraction of total_timesteps over which epsilon falls to end_e."""
    learning_starts: int = 10_000
    """Env steps before learning starts."""
    train_frequency: int = 10
    """Env steps between gradient steps."""
    prioritized: bool = False
    """Prioritized replay (alpha 0.6, beta 0.4, priorities |TD error| + 1e-6)."""
    eval_episodes: int = 10
    """Greedy episodes played after training (0: none)."""
    torch_threads: int = 1
    """torch's CPU threads (not in CleanRL: for a 120-84 MLP more threads only add overhead)."""


def parse_args(argv: list[str] | None = None) -> Args:
    """Args from command-line flags (defaults from :class:`Args`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(Args):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default)
    return Args(**vars(parser.parse_args(argv)))


class QNetwork(nn.Module):
    """CleanRL's Q-network: 120-84 ReLU MLP."""

    def __init__(self, envs: gym.vector.VectorEnv) -> None:
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(int(np.prod(envs.single_observation_space.shape)), 120), nn.ReLU(),
            nn.Linear(120, 84), nn.ReLU(),
            nn.Linear(84, int(envs.single_action_space.n)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)


def linear_schedule(start_e: float, end_e: float, duration: int, t: int) -> float:
    """Epsilon falling linearly from ``start_e`` to ``end_e`` over ``duration`` steps."""
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def train(args: Args) -> dict[str, float]:
    """CleanRL's DQN loop on shardreplay; returns figures of the run."""
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.torch_threads)
    envs = gym.make_vec(args.env_id, num_envs=1, vectorization_mode="sync",
                        wrappers=[gym.wrappers.RecordEpisodeStatistics])
    q_network = QNetwork(envs)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network = QNetwork(envs)
    target_network.load_state_dict(q_network.state_dict())
    rb = ReplayBuffer(spec_from_env(envs), num_streams=1, stream_capacity=args.buffer_size, seed=args.seed,
                      sampler="prioritized" if args.prioritized else "uniform")
    rb_writer = GymStepWriter.from_env(envs, rb)
    start_time, start_cpu = time.perf_counter(), time.process_time()
    returns: list[float] = []
    losses: list[float] = []

    obs, _ = envs.reset(seed=args.seed)
    rb_writer.reset(obs)
    for global_step in range(args.total_timesteps):
        epsilon = linear_schedule(args.start_e, args.end_e,
                                  int(args.exploration_fraction * args.total_timesteps), global_step)
        if random.random() < epsilon:
            actions = np.array([envs.single_action_space.sample() for _ in range(envs.num_envs)])
        else:
            q_values = q_network(torch.Tensor(obs))
            actions = torch.argmax(q_values, dim=1).numpy()
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        if "episode" in infos:
            returns += infos["episode"]["r"][infos["_episode"]].tolist()
        rb_writer.step(actions, next_obs, rewards, terminations, truncations, infos)
        obs = next_obs

        if global_step > args.learning_starts:
            if global_step % args.train_frequency == 0:
                data = rb.sample_transitions(args.batch_size, gamma=args.gamma)
                with torch.no_grad():
                    target_max, _ = target_network(data.next_obs).max(dim=1)
                    td_target = data.reward + data.bootstrap_discount * target_max
                old_val = q_network(data.obs).gather(1, data.action.view(-1, 1)).squeeze(1)
                if args.prioritized:
                    td = td_target - old_val
                    loss = (data.weights * td**2).mean()
                    rb.update_priorities(data.keys, td.detach().abs() + 1e-6)
                else:
                    loss = F.mse_loss(td_target, old_val)
                losses.append(float(loss.detach()))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

            if global_step % args.target_network_frequency == 0:
                for target_param, q_param in zip(target_network.parameters(), q_network.parameters(),
                                                 strict=True):
                    target_param.data.copy_(args.tau * q_param.data + (1.0 - args.tau) * target_param.data)
    seconds, cpu_seconds = time.perf_counter() - start_time, time.process_time() - start_cpu
    envs.close()
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "episodes": len(returns),
            "stored_steps": rb.num_steps,
            "first_returns": float(np.mean(returns[:10])) if returns else 0.0,
            "last_returns": float(np.mean(returns[-10:])) if returns else 0.0,
            "eval_return": evaluate(q_network, args), "gradient_steps": len(losses),
            "last_loss": float(np.mean(losses[-50:])) if losses else 0.0}


def evaluate(q_network: nn.Module, args: Args) -> float:
    """Mean return of ``eval_episodes`` greedy episodes (0 when none are asked for)."""
    if args.eval_episodes < 1:
        return 0.0
    env = gym.make(args.env_id)
    total = 0.0
    for episode in range(args.eval_episodes):
        obs, _ = env.reset(seed=args.seed + 10_000 + episode)
        done = False
        while not done:
            with torch.no_grad():
                action = int(q_network(torch.as_tensor(obs, dtype=torch.float32)[None]).argmax())
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
    env.close()
    return total / args.eval_episodes


def main(argv: list[str] | None = None) -> None:
    """Train and print the figures of the run, one per line."""
    args = parse_args(argv)
    figures = train(args)
    print(f"replay           {'prioritized' if args.prioritized else 'uniform'}")
    for name, value in figures.items():
        print(f"{name:<16} {value:.4f}")
    print("done")


if __name__ == "__main__":
    main()
