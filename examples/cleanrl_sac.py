"""CleanRL's sac_continuous_action.py, ported onto shardreplay (uniform or prioritized replay).

The loop is CleanRL's (``cleanrl/sac_continuous_action.py``: a tanh-Gaussian actor, twin
soft Q-networks with polyak targets, automatic entropy tuning, delayed policy updates
``policy_frequency`` times every ``policy_frequency`` steps), with its replay buffer
replaced. What changed:

* ``GymStepWriter`` writes what ``envs.step`` returned (no ``real_next_obs`` juggling);
* ``rb.sample_transitions(batch_size, gamma=...)`` gives ``reward`` and
  ``bootstrap_discount`` (gamma, 0 after a termination; a truncation bootstraps), so
  the target is ``reward + bootstrap_discount * (min Q_target(next_obs, a') - alpha * log pi(a'))``;
* ``--prioritized`` samples with priorities ``(|delta_1| + |delta_2|) / 2`` (the mean of
  the twin critics' TD errors, as ``train --algo sac``) and weights the critic loss.

Run: ``python examples/cleanrl_sac.py`` (Pendulum-v1; ``--help`` lists the settings,
``--env-id HalfCheetah-v5`` needs the ``mujoco`` extra).
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

LOG_STD_MAX, LOG_STD_MIN = 2.0, -5.0


@dataclass(frozen=True)
class Args:
    """CleanRL's settings (each is also a flag, e.g. ``--total-timesteps 20000``)."""

    seed: int = 1
    """Seeds python, numpy, torch, the env and the buffer."""
    env_id: str = "Pendulum-v1"
    """The gymnasium environment (Box actions)."""
    total_timesteps: int = 20_000
    """Env steps in all (CleanRL's 1,000,000 are for MuJoCo)."""
    buffer_size: int = 1_000_000
    """Replay capacity in steps."""
    gamma: float = 0.99
    """Discount factor."""
    tau: float = 0.005
    """Target smoothing coefficient."""
    batch_size: int = 256
    """Transitions per gradient step."""
    learning_starts: int = 5000
    """Env steps before learning starts (random actions until then)."""
    policy_lr: float = 3e-4
    """The policy's learning rate."""
    q_lr: float = 1e-3
    """The Q-networks' learning rate."""
    policy_frequency: int = 2
    """Steps between policy updates (TD3's delay; done that many times, to compensate)."""
    target_network_frequency: int = 1
    """Steps between target updates."""
    alpha: float = 0.2
    """Entropy coefficient (the start when autotuned)."""
    autotune: bool = True
    """Tune the entropy coefficient automatically (--no-autotune: keep alpha)."""
    prioritized: bool = False
    """Prioritized replay (alpha 0.6, beta 0.4)."""
    eval_episodes: int = 5
    """Deterministic episodes played after training (0: none)."""
    torch_threads: int = 1
    """torch's CPU threads (not in CleanRL: small MLPs gain nothing from more)."""


def parse_args(argv: list[str] | None = None) -> Args:
    """Args from command-line flags (defaults from :class:`Args`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(Args):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default)
    return Args(**vars(parser.parse_args(argv)))


class SoftQNetwork(nn.Module):
    """CleanRL's soft Q-network: 256-256 ReLU MLP of (obs, action)."""

    def __init__(self, envs: gym.vector.VectorEnv) -> None:
        super().__init__()
        size = int(np.prod(envs.single_observation_space.shape) + np.prod(envs.single_action_space.shape))
        self.fc1, self.fc2, self.fc3 = nn.Linear(size, 256), nn.Linear(256, 256), nn.Linear(256, 1)

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(torch.cat([x, a], 1)))
        return self.fc3(F.relu(self.fc2(x)))


class Actor(nn.Module):
    """CleanRL's actor: a 256-256 MLP to a tanh-squashed Gaussian in the action bounds."""

    def __init__(self, envs: gym.vector.VectorEnv) -> None:
        super().__init__()
        obs, act = envs.single_observation_space, envs.single_action_space
        self.fc1, self.fc2 = nn.Linear(int(np.prod(obs.shape)), 256), nn.Linear(256, 256)
        size = int(np.prod(act.shape))
        self.fc_mean, self.fc_logstd = nn.Linear(256, size), nn.Linear(256, size)
        scale, bias = (act.high - act.low) / 2.0, (act.high + act.low) / 2.0
        self.register_buffer("action_scale", torch.tensor(scale, dtype=torch.float32))
        self.register_buffer("action_bias", torch.tensor(bias, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.relu(self.fc2(F.relu(self.fc1(x))))
        log_std = torch.tanh(self.fc_logstd(x))
        return self.fc_mean(x), LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)

    def get_action(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sampled action, its log-probability [B, 1], the squashed mean)."""
        mean, log_std = self(x)
        normal = torch.distributions.Normal(mean, log_std.exp())
        x_t = normal.rsample()
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t) - torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        return action, log_prob.sum(1, keepdim=True), torch.tanh(mean) * self.action_scale + self.action_bias


def train(args: Args) -> dict[str, float]:
    """CleanRL's SAC loop on shardreplay; returns figures of the run."""
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.torch_threads)
    envs = gym.make_vec(args.env_id, num_envs=1, vectorization_mode="sync",
                        wrappers=[gym.wrappers.RecordEpisodeStatistics])
    envs.single_action_space.seed(args.seed)
    actor = Actor(envs)
    qf1, qf2, qf1_target, qf2_target = (SoftQNetwork(envs) for _ in range(4))
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    q_optimizer = torch.optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=args.q_lr)
    actor_optimizer = torch.optim.Adam(list(actor.parameters()), lr=args.policy_lr)
    alpha = args.alpha
    if args.autotune:
        target_entropy = -float(np.prod(envs.single_action_space.shape))
        log_alpha = torch.zeros(1, requires_grad=True)
        alpha = float(log_alpha.detach().exp())
        a_optimizer = torch.optim.Adam([log_alpha], lr=args.q_lr)
    rb = ReplayBuffer(spec_from_env(envs), num_streams=1,
                      stream_capacity=min(args.buffer_size, args.total_timesteps + 1), seed=args.seed,
                      sampler="prioritized" if args.prioritized else "uniform")
    rb_writer = GymStepWriter.from_env(envs, rb)
    start_time = time.perf_counter()
    returns: list[float] = []
    q_losses: list[float] = []

    obs, _ = envs.reset(seed=args.seed)
    rb_writer.reset(obs)
    for global_step in range(args.total_timesteps):
        if global_step < args.learning_starts:
            actions = np.array([envs.single_action_space.sample() for _ in range(envs.num_envs)])
        else:
            actions, _, _ = actor.get_action(torch.Tensor(obs))
            actions = actions.detach().numpy()
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        if "episode" in infos:
            returns += infos["episode"]["r"][infos["_episode"]].tolist()
        rb_writer.step(actions, next_obs, rewards, terminations, truncations, infos)
        obs = next_obs

        if global_step > args.learning_starts:
            data = rb.sample_transitions(args.batch_size, gamma=args.gamma)
            with torch.no_grad():
                next_state_actions, next_state_log_pi, _ = actor.get_action(data.next_obs)
                min_qf_next_target = torch.min(qf1_target(data.next_obs, next_state_actions),
                                               qf2_target(data.next_obs, next_state_actions)) \
                    - alpha * next_state_log_pi
                next_q_value = data.reward + data.bootstrap_discount * min_qf_next_target.view(-1)
            qf1_a_values = qf1(data.obs, data.action).view(-1)
            qf2_a_values = qf2(data.obs, data.action).view(-1)
            if args.prioritized:
                d1, d2 = next_q_value - qf1_a_values, next_q_value - qf2_a_values
                qf_loss = (data.weights * (d1**2 + d2**2)).mean()
                rb.update_priorities(data.keys, (d1.detach().abs() + d2.detach().abs()) / 2 + 1e-6)
            else:
                qf_loss = F.mse_loss(qf1_a_values, next_q_value) + F.mse_loss(qf2_a_values, next_q_value)
            q_losses.append(float(qf_loss.detach()))
            q_optimizer.zero_grad()
            qf_loss.backward()
            q_optimizer.step()

            if global_step % args.policy_frequency == 0:  # TD3's delayed update
                for _ in range(args.policy_frequency):
                    pi, log_pi, _ = actor.get_action(data.obs)
                    min_qf_pi = torch.min(qf1(data.obs, pi), qf2(data.obs, pi))
                    actor_loss = ((alpha * log_pi) - min_qf_pi).mean()
                    actor_optimizer.zero_grad()
                    actor_loss.backward()
                    actor_optimizer.step()
                    if args.autotune:
                        with torch.no_grad():
                            _, log_pi, _ = actor.get_action(data.obs)
                        alpha_loss = (-log_alpha.exp() * (log_pi + target_entropy)).mean()
                        a_optimizer.zero_grad()
                        alpha_loss.backward()
                        a_optimizer.step()
                        alpha = float(log_alpha.detach().exp())

            if global_step % args.target_network_frequency == 0:
                for net, target in ((qf1, qf1_target), (qf2, qf2_target)):
                    for param, target_param in zip(net.parameters(), target.parameters(), strict=True):
                        target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)
    seconds = time.perf_counter() - start_time
    envs.close()
    return {"seconds": seconds, "episodes": len(returns), "stored_steps": rb.num_steps,
            "first_returns": float(np.mean(returns[:5])) if returns else 0.0,
            "last_returns": float(np.mean(returns[-5:])) if returns else 0.0,
            "eval_return": evaluate(actor, args), "gradient_steps": len(q_losses),
            "last_q_loss": float(np.mean(q_losses[-50:])) if q_losses else 0.0, "alpha": alpha}


def evaluate(actor: Actor, args: Args) -> float:
    """Mean return of ``eval_episodes`` episodes of the squashed mean action (0 when none)."""
    if args.eval_episodes < 1:
        return 0.0
    env = gym.make(args.env_id)
    total = 0.0
    for episode in range(args.eval_episodes):
        obs, _ = env.reset(seed=args.seed + 10_000 + episode)
        done = False
        while not done:
            with torch.no_grad():
                _, _, action = actor.get_action(torch.as_tensor(obs, dtype=torch.float32)[None])
            obs, reward, terminated, truncated, _ = env.step(action[0].numpy())
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
