"""Soft Actor-Critic (Haarnoja et al. 2018) for Box actions, on sampled n-step windows.

A tanh-Gaussian policy ``a = bias + scale * tanh(u)``, ``u ~ N(mu(o), sigma(o))``, twin
Q-networks with polyak-averaged targets and a learned temperature ``alpha``::

    a', logp' ~ pi(. | o_m)
    target  = R + gamma_m * (min_i Q_target_i(o_m, a') - alpha * logp')   (gamma_m = 0 after a termination)
    delta_i = target - Q_i(o_0, a_0)                                        (i = 1, 2)
    critic  = mean_b( w_b * (delta_1^2 + delta_2^2) )                      (w: importance weights)
    actor   = mean_b( alpha * logp(a~|o_0) - min_i Q_i(o_0, a~) )
    alpha   = mean_b( -alpha * (logp(a~|o_0) + target_entropy) )            (target_entropy = -dim A)
    Q_target <- (1 - tau) Q_target + tau Q                                  (every update)

New priorities: ``(|delta_1| + |delta_2|) / 2 + priority_eps``; several ranks: docs/train.md,
"Algorithms". :data:`SAC` is the algorithm ``train --algo sac`` runs.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from shardreplay.buffer.batch import Batch
from shardreplay.buffer.nstep import nstep_transitions
from shardreplay.runtime.actor.settings import ActorSettings
from shardreplay.runtime.algos.base import Algorithm, check_fits, network_weights, warmup
from shardreplay.runtime.algos.networks import mlp
from shardreplay.runtime.algos.torch_parts import (
    LearnerState,
    Part,
    TorchPolicy,
    flat_observations,
    soft_update,
)
from shardreplay.runtime.devices import CPU, Placement
from shardreplay.runtime.envs import EnvInfo
from shardreplay.runtime.settings import TrainSettings

__all__ = ["SAC", "Sac", "SacAlgorithm", "SacSettings", "SampledPolicy", "SquashedGaussianActor",
           "TwinQ"]

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0  # CleanRL's bounds on the policy's log standard deviation


class SquashedGaussianActor(nn.Module):
    """The policy: an MLP to the mean and log standard deviation of a Gaussian, squashed
    by tanh into the action bounds ``low`` .. ``high`` (one per dimension)."""

    action_scale: torch.Tensor
    action_bias: torch.Tensor

    def __init__(self, obs_size: int, low: Sequence[float], high: Sequence[float],
                 hidden: Sequence[int] = (256, 256)) -> None:
        super().__init__()
        lo, hi = torch.tensor(low, dtype=torch.float32), torch.tensor(high, dtype=torch.float32)
        self.net, width = mlp(obs_size, hidden)
        self.mean = nn.Linear(width, len(lo))
        self.log_std = nn.Linear(width, len(lo))
        # buffers: published with the weights, so actors act in the learners' bounds
        self.register_buffer("action_scale", (hi - lo) / 2)
        self.register_buffer("action_bias", (hi + lo) / 2)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and log standard deviation ``[B, d]`` (the latter in [-5, 2])."""
        h = self.net(obs.to(torch.float32))
        log_std = torch.tanh(self.log_std(h))
        return self.mean(h), LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)

    def sample(self, obs: torch.Tensor, generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Actions ``[B, d]`` drawn (reparameterised) and their log-probabilities ``[B]``."""
        mean, log_std = self(obs)
        std = log_std.exp()
        noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
        u = mean + std * noise
        y = torch.tanh(u)
        log_prob = (-0.5 * noise.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(1)
        # the change of variables of tanh and the scale (CleanRL's 1e-6 keeps log finite)
        log_prob = log_prob - torch.log(self.action_scale * (1 - y.pow(2)) + 1e-6).sum(1)
        return y * self.action_scale + self.action_bias, log_prob

    def deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        """The evaluation's action: the squashed mean."""
        mean, _ = self(obs)
        return torch.tanh(mean) * self.action_scale + self.action_bias


class TwinQ(nn.Module):
    """Two Q-networks ``Q_i(o, a)``, MLPs of the observation and action concatenated."""

    def __init__(self, obs_size: int, action_size: int, hidden: Sequence[int] = (256, 256)) -> None:
        super().__init__()
        trunk1, width = mlp(obs_size + action_size, hidden)
        trunk2, _ = mlp(obs_size + action_size, hidden)
        self.q1 = nn.Sequential(*trunk1, nn.Linear(width, 1))
        self.q2 = nn.Sequential(*trunk2, nn.Linear(width, 1))

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Q_1, Q_2)``, each ``[B]``."""
        x = torch.cat([obs.to(torch.float32), action.to(torch.float32)], dim=1)
        return self.q1(x).squeeze(1), self.q2(x).squeeze(1)


@dataclass(frozen=True)
class SacSettings:
    """SAC's learning settings: the Adam learning rates of the policy, the twin critics and
    ``log alpha``, the target critics' polyak rate ``tau`` (every update), the temperature
    at the start and the entropy it aims at (None: ``-dim A``)."""

    gamma: float = 0.99
    actor_lr: float = 3e-4
    critic_lr: float = 1e-3
    alpha_lr: float = 1e-3
    tau: float = 0.005
    init_alpha: float = 1.0
    target_entropy: float | None = None
    priority_eps: float = 1e-3


class Sac(LearnerState):
    """Policy, twin critics, their targets, the temperature, the optimizers and one
    learning step (see the module docstring); its ``state_dict`` holds ``actor``,
    ``critic``, ``critic_target``, ``log_alpha``, the three optimizers and ``updates``.

    ``world`` ranks learn together (> 1: a collective on ``placement``'s group at
    construction and in every :meth:`learn`); ``placement`` None: the CPU and the default group.
    """

    algo, state_key = "sac", "critic_target"

    def __init__(self, actor: SquashedGaussianActor, critic: TwinQ, settings: SacSettings,
                 world: int = 1, placement: Placement | None = None) -> None:
        self.placement = placement or CPU
        device = self.placement.device
        self.actor, self.critic = actor.to(device), critic.to(device)
        self.settings, self.world = settings, world
        self.log_alpha = nn.Parameter(torch.tensor(math.log(settings.init_alpha), dtype=torch.float32,
                                                   device=device))
        if world > 1:  # every rank starts from rank 0's networks, as DDP does
            for t in [*actor.parameters(), *actor.buffers(), *critic.parameters(), self.log_alpha]:
                dist.broadcast(t.data, src=0, group=self.placement.ddp_group)  # every rank is in it
        self.critic_target = copy.deepcopy(critic).requires_grad_(False)
        self.actor_opt = torch.optim.Adam(actor.parameters(), lr=settings.actor_lr)
        self.critic_opt = torch.optim.Adam(critic.parameters(), lr=settings.critic_lr)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=settings.alpha_lr)
        dim = int(actor.mean.out_features)
        self.target_entropy = -float(dim) if settings.target_entropy is None else settings.target_entropy
        self.updates = 0

    @property
    def module(self) -> nn.Module:
        """The policy (what actors act with and evaluation runs)."""
        return self.actor

    @property
    def alpha(self) -> float:
        """The current temperature."""
        return float(self.log_alpha.detach().exp())

    def learn(self, batch: Batch) -> tuple[torch.Tensor, float]:
        """One update on ``batch``; returns (new priorities ``[B]``, critic loss).

        Raises:
            ConfigError: the batch's observations are nested (a dict), not one tensor.
        """
        s = self.settings
        tr = nstep_transitions(batch, s.gamma, validate=False)
        obs, next_obs = flat_observations(tr, "Sac")
        action, weights = tr.action.float(), batch.weights.float()
        alpha = self.log_alpha.detach().exp()
        with torch.no_grad():
            next_action, next_logp = self.actor.sample(next_obs)
            tq1, tq2 = self.critic_target(next_obs, next_action)
            soft = torch.min(tq1, tq2) - alpha * next_logp
            target = tr.reward.float() + tr.bootstrap_discount.float() * soft
        q1, q2 = self.critic(obs, action)
        d1, d2 = target - q1, target - q2
        critic_loss = (weights * (d1.pow(2) + d2.pow(2))).mean()
        # Actor and temperature: rows of real samples only (a padding batch has weights 0).
        real = (weights > 0).float()
        count = real.sum().clamp(min=1.0)
        new_action, logp = self.actor.sample(obs)
        pq1, pq2 = self.critic(obs, new_action)
        actor_loss = (real * (alpha * logp - torch.min(pq1, pq2))).sum() / count
        alpha_loss = (real * (-self.log_alpha.exp() * (logp.detach() + self.target_entropy))).sum() / count
        self._step(critic_loss, actor_loss, alpha_loss)
        return (d1.detach().abs() + d2.detach().abs()) / 2 + s.priority_eps, float(critic_loss.detach())

    def _step(self, critic_loss: torch.Tensor, actor_loss: torch.Tensor, alpha_loss: torch.Tensor) -> None:
        """Gradients of each loss for its own parameters (the actor and the temperature
        learn from the critics before this step), averaged over ranks in one all-reduce;
        the three Adam steps; the soft target update."""
        groups = [list(self.critic.parameters()), list(self.actor.parameters()), [self.log_alpha]]
        grads = [torch.autograd.grad(loss, params)
                 for loss, params in zip((critic_loss, actor_loss, alpha_loss), groups, strict=True)]
        flat = torch.cat([g.reshape(-1) for gs in grads for g in gs])
        if self.world > 1:
            dist.all_reduce(flat, group=self.placement.ddp_group)
            flat /= self.world
        offset = 0
        for params in groups:
            for p in params:
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        for opt in (self.critic_opt, self.actor_opt, self.alpha_opt):
            opt.step()
        self.updates += 1
        soft_update(self.critic_target, self.critic, self.settings.tau)

    def _state_parts(self) -> dict[str, Part]:
        """Networks, target critics, temperature and optimizers (then the update count)."""
        return {"actor": self.actor, "critic": self.critic, "critic_target": self.critic_target,
                "log_alpha": self.log_alpha, "actor_opt": self.actor_opt, "critic_opt": self.critic_opt,
                "alpha_opt": self.alpha_opt}


class SampledPolicy(TorchPolicy):
    """An actor's SAC policy: actions sampled from the published tanh-Gaussian, uniformly
    random ones with probability falling from 1 to 0 over the run's warm-up
    (``epsilon_warmup_steps``). Arguments as :class:`~.torch_parts.TorchPolicy`'s.
    """

    net: SquashedGaussianActor

    def __init__(self, net: SquashedGaussianActor, s: ActorSettings) -> None:
        super().__init__(net, s)
        self.rng = np.random.default_rng(s.seed)
        self.generator = torch.Generator(self.device).manual_seed(int(self.rng.integers(2**62)))
        self.warmup_steps = s.epsilon_warmup_steps or 0
        self.zero = np.zeros(s.envs_per_actor or 1)

    def act(self, obs: np.ndarray, state: None, run_steps: int) -> tuple[np.ndarray, None]:
        """Sampled actions ``[num_envs, d]`` (float32), random ones during warm-up."""
        with torch.no_grad():
            obs_t = torch.as_tensor(obs, device=self.device)
            actions = self.net.sample(obs_t, self.generator)[0].cpu().numpy().astype(np.float32)
        explore = warmup(self.zero, run_steps, self.warmup_steps)
        rows = self.rng.random(len(actions)) < explore
        if rows.any():
            lo = (self.net.action_bias - self.net.action_scale).cpu().numpy()
            hi = (self.net.action_bias + self.net.action_scale).cpu().numpy()
            actions[rows] = self.rng.uniform(lo, hi, size=(int(rows.sum()), actions.shape[1]))
        return actions, None


class SacAlgorithm(Algorithm):
    """``--algo sac``: Soft Actor-Critic on flat Box actions (the flags it takes, ``--lr``
    for the critics and the temperature, ``lr / 3`` for the policy: docs/train.md)."""

    name = "sac"
    actions = "box"
    policy_key = "actor"

    def policy_network(self, env: EnvInfo, network: str, hidden: tuple[int, ...]) -> SquashedGaussianActor:
        """The tanh-Gaussian policy of ``hidden`` sizes in the env's action bounds
        (``network``: auto or mlp, refused otherwise by the settings)."""
        return SquashedGaussianActor(env.obs_shape[0], env.action_low, env.action_high, hidden)

    def make_agent(self, env: EnvInfo, settings: TrainSettings, world: int,
                   placement: Placement | None = None) -> Sac:
        """Policy and twin critics of ``--hidden`` sizes and their learner."""
        ls = settings.learners
        actor = self.policy_network(env, ls.network, ls.hidden)
        critic = TwinQ(env.obs_shape[0], env.action_shape[0], ls.hidden)
        return Sac(actor, critic, SacSettings(gamma=ls.gamma, actor_lr=ls.lr / 3, critic_lr=ls.lr,
                                              alpha_lr=ls.lr), world=world, placement=placement)

    def make_policy(self, weights: Mapping[str, Any], env: EnvInfo, s: ActorSettings) -> SampledPolicy:
        """The policy the published weights fit (its hidden sizes read from them).

        Raises:
            ConfigError: the weights are not a SAC policy for this environment.
        """
        shapes = {k: tuple(v.shape) for k, v in network_weights(weights).items()}
        layers = sorted((int(k.split(".")[1]), shape) for k, shape in shapes.items()
                        if k.startswith("net.") and k.endswith(".weight"))
        hidden = tuple(out for _i, (out, _in) in layers)
        actor = SquashedGaussianActor(env.obs_shape[0], env.action_low, env.action_high, hidden)
        check_fits(actor, weights, s, env, "a SAC policy", "with --algo sac", ok=bool(hidden))
        policy = SampledPolicy(actor, s)
        policy.load(network_weights(weights))
        return policy

    def greedy(self, module: nn.Module) -> Any:
        """The squashed mean action."""
        assert isinstance(module, SquashedGaussianActor)
        return lambda obs: module.deterministic(obs).cpu().numpy()


SAC = SacAlgorithm()
