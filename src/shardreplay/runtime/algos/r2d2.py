"""R2D2 (Kapturowski et al. 2019): a recurrent Q-network learning from stored sequences
(actors, stored state and sequence windows: docs/train.md, "Algorithms"). On each
sampled sequence the learner::

    state  = (h, c) stored at the sequence's first step
    unroll = online LSTM over the first burn_in steps from state   (no loss, no gradient)
    q_t    = online Q over the rest, from the burned-in state
    target = G_t^(n) + gamma^m d Q_target(o_{t+m}, argmax_a q_{t+m})  (double Q, n-step;
             m = min(n, steps to the episode's LAST); the target net unrolls from state)
    loss   = mean_b( w_b * mean_t huber(q_t(a_t) - target_t) )       over learn_mask steps
    priority_b = 0.9 max_t |delta_t| + 0.1 mean_t |delta_t| + priority_eps

No value rescaling; the target network is a hard copy every ``--target-update-interval``
updates. :data:`R2D2` is the algorithm ``train --algo r2d2`` runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shardreplay.buffer.batch import Batch
from shardreplay.buffer.sequences import SequenceBatch, sequence_batch, sequence_priorities
from shardreplay.errors import ConfigError
from shardreplay.runtime.actor.settings import ActorSettings
from shardreplay.runtime.algos.base import Algorithm, check_fits, network_weights, published_hidden
from shardreplay.runtime.algos.dqn_torch import DqnSettings
from shardreplay.runtime.algos.torch_parts import ApexActor, QLearner
from shardreplay.runtime.devices import CPU, Placement, wrap
from shardreplay.runtime.envs import EnvInfo
from shardreplay.runtime.settings import TrainSettings
from shardreplay.spec import StepType

__all__ = ["R2D2", "R2d2", "R2d2Algorithm", "R2d2Settings", "RecurrentPolicy", "RecurrentQ",
           "nstep_targets", "sequence_loss"]

State = tuple[torch.Tensor, torch.Tensor]
STATE_FIELDS = ("h", "c")  # the spec fields holding the actor's LSTM state at each step


class RecurrentQ(nn.Module):
    """Observation -> ReLU layer -> LSTM -> Q-values, unrolled over ``[B, T]`` (``hidden``:
    units of the embedding and of the LSTM)."""

    def __init__(self, obs_dim: int, num_actions: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Linear(obs_dim, hidden)
        self.lstm = nn.LSTM(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, num_actions)

    def initial_state(self, batch: int, device: torch.device | None = None) -> State:
        """The zero state ``([B, H], [B, H])`` an episode starts from."""
        zeros = torch.zeros(batch, self.lstm.hidden_size, device=device)
        return zeros, zeros.clone()

    def forward(self, obs: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """Q-values ``[B, T, A]`` and the final state, for ``obs`` ``[B, T, obs_dim]`` from
        ``state`` ``([B, H], [B, H])``."""
        out, (h, c) = self.lstm(F.relu(self.embed(obs.float())), (state[0][None], state[1][None]))
        return self.head(out), (h[0], c[0])


def nstep_targets(data: Mapping[str, torch.Tensor], mask: torch.Tensor, q_online: torch.Tensor,
                  q_target: torch.Tensor, n: int, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Double-Q n-step targets for positions ``0 .. L-n-1`` of ``[B, L]`` sequences and
    which of them count.

    Returns ``G_t + gamma^m d_{t+m} Q_target(o_{t+m}, argmax_a Q_online(o_{t+m}, a))`` with
    ``m = min(n, steps to the episode's LAST)`` (dm_env: the LAST step's discount is 0
    after a termination, 1 after a truncation) and the positions that are stored steps
    with an action (not LAST, not padding). ``q_online`` / ``q_target``: ``[B, L, A]``.
    """
    device = mask.device
    rows, length = mask.shape
    span = length - n
    reward, discount = data["reward"].float(), data["discount"].float()
    is_last = (data["step_type"] == StepType.LAST) & mask
    steps = torch.arange(span, device=device)
    ret = torch.zeros(rows, span, device=device)
    scale = torch.ones(rows, span, device=device)
    ended = torch.zeros(rows, span, dtype=torch.bool, device=device)
    boot = torch.full((rows, span), n, dtype=torch.long, device=device) + steps
    boot_scale = torch.zeros(rows, span, device=device)
    for k in range(n):
        ret = ret + torch.where(ended, 0.0, scale * reward[:, k:k + span])
        scale = torch.where(ended, scale, scale * gamma)
        last_next = is_last[:, k + 1:k + 1 + span] & ~ended
        boot = torch.where(last_next, steps + k + 1, boot)
        boot_scale = torch.where(last_next, scale * discount[:, k + 1:k + 1 + span], boot_scale)
        ended = ended | last_next
    boot_scale = torch.where(ended, boot_scale, scale * discount.gather(1, boot))
    best = q_online.gather(1, boot[..., None].expand(-1, -1, q_online.shape[-1])).argmax(-1)
    q_next = q_target.gather(1, boot[..., None].expand(-1, -1, q_target.shape[-1]))
    q_next = q_next.gather(2, best[..., None])[..., 0]
    counts = mask[:, :span] & (data["step_type"][:, :span] != StepType.LAST)
    return ret + boot_scale * q_next, counts


def sequence_loss(online: nn.Module, target: nn.Module, seq: SequenceBatch, n: int,
                  gamma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """R2D2's loss on ``seq``, sequences with their stored start state in
    ``start_state["h"]``, ``["c"]`` (see the module docstring): ``online`` (maybe in DDP)
    unrolls the burn-in without gradient, then the learning part with it.

    Returns:
        ``(loss, td, learn_here)``: the importance-weighted loss; TD errors ``[B, L - n]``
        and the positions of them that are learned from (burn-in, padding, LAST and the
        last ``n`` positions are not).
    """
    data, mask, burn = seq.batch.data, seq.batch.mask, seq.burn_in
    obs = data["obs"]
    start = (seq.start_state["h"].float(), seq.start_state["c"].float())
    with torch.no_grad():
        burned = online(obs[:, :burn], start)[1] if burn else start
        q_tgt, _ = target(obs, start)
    q_learn, _ = online(obs[:, burn:], burned)
    # Burn-in positions get no loss: their online Q is a placeholder (no gradient).
    q_on = torch.cat([q_learn.new_zeros(obs.shape[0], burn, q_learn.shape[-1]), q_learn], dim=1)
    with torch.no_grad():
        targets, counts = nstep_targets(data, mask, q_on.detach(), q_tgt, n, gamma)
    span = targets.shape[1]
    learn_here = seq.learn_mask[:, :span] & counts
    q_taken = q_on[:, :span].gather(2, data["action"][:, :span, None].long())[..., 0]
    per_step = F.smooth_l1_loss(q_taken, targets, reduction="none") * learn_here
    per_seq = per_step.sum(1) / learn_here.sum(1).clamp(min=1)
    loss = (seq.weights.float() * per_seq).mean()
    return loss, (q_taken - targets).detach(), learn_here


@dataclass(frozen=True)
class R2d2Settings(DqnSettings):
    """R2D2's learning settings: DQN's (the target a hard copy every
    ``target_update_interval`` updates), other defaults, and

    Attributes:
        n_step: n of the n-step targets.
        burn_in: steps of each sequence unrolled without loss.
    """

    lr: float = 3e-3
    target_update_interval: int = 100
    adam_eps: float = 1e-4  # examples/r2d2_cartpole.py's (R2D2's is 1e-3; 1e-8 is noisier here)
    n_step: int = 5
    burn_in: int = 4


class R2d2(QLearner):
    """R2D2's learning step on online and target recurrent Q-networks
    (:class:`~.torch_parts.QLearner`; ``state_dict``: ``recurrent_online``, ``target``,
    ``optimizer``, ``updates``)."""

    algo, state_key = "r2d2", "recurrent_online"

    def learn(self, batch: Batch) -> tuple[torch.Tensor, float]:
        """One gradient step on sampled sequences; returns (new priorities ``[B]``, loss).

        Raises:
            ConfigError: the batch has no stored state (``h``, ``c``) or too short windows.
        """
        s = self.settings
        if batch.mask.shape[1] <= s.burn_in + s.n_step:
            raise ConfigError(f"R2D2 needs windows longer than burn_in + n_step ({s.burn_in} + {s.n_step}), "
                              f"got {batch.mask.shape[1]}: raise --seq-len")
        seq = sequence_batch(batch, burn_in=s.burn_in, state=STATE_FIELDS)
        loss, td, learn_here = sequence_loss(self.online, self.target, seq, s.n_step, s.gamma)
        self._step(loss)
        return sequence_priorities(td, learn_here) + s.priority_eps, float(loss.detach())


class RecurrentPolicy(ApexActor):
    """An actor's recurrent Q-network acting epsilon-greedily with Ape-X's epsilons
    (:class:`~.torch_parts.ApexActor`, as DQN's), its LSTM state kept per env.
    """

    net: RecurrentQ

    def initial_state(self, num_envs: int) -> State:
        """Zeros: every env starts an episode."""
        return self.net.initial_state(num_envs, self.device)

    def act(self, obs: np.ndarray, state: State, run_steps: int) -> tuple[np.ndarray, State]:
        """Epsilon-greedy actions and the LSTM state after this observation."""
        with torch.no_grad():
            q, nxt = self.net(torch.as_tensor(obs, device=self.device)[:, None], state)
        greedy = q[:, 0].argmax(dim=1).cpu().numpy()
        return self.exploration.actions(greedy, int(q.shape[-1]), run_steps), nxt

    def end_episodes(self, state: State, starting: np.ndarray) -> State:
        """``state`` with the rows of envs that start an episode zeroed."""
        keep = torch.as_tensor(~np.asarray(starting, bool), dtype=torch.float32, device=self.device)[:, None]
        return state[0] * keep, state[1] * keep

    def stored(self, state: State) -> dict[str, np.ndarray]:
        """``h`` and ``c`` ``[num_envs, H]`` (copies), written with the steps acted from them."""
        return {name: t.detach().cpu().numpy().copy() for name, t in zip(STATE_FIELDS, state, strict=True)}


class R2d2Algorithm(Algorithm):
    """``--algo r2d2``: a recurrent Q-network on sequences (the flags it takes: docs/train.md)."""

    name = "r2d2"
    actions = "discrete"
    policy_key = "recurrent_online"

    def policy_network(self, env: EnvInfo, network: str, hidden: tuple[int, ...]) -> RecurrentQ:
        """The recurrent Q-network: an LSTM of ``hidden[-1]`` units (``network``: auto or
        mlp, refused otherwise by the settings)."""
        return RecurrentQ(env.obs_shape[0], env.num_actions, hidden[-1])

    def make_agent(self, env: EnvInfo, settings: TrainSettings, world: int,
                   placement: Placement | None = None) -> R2d2:
        """The recurrent Q-network (in DDP over the placement's group on several ranks)
        and its learner."""
        ls = settings.learners
        net = wrap(self.policy_network(env, ls.network, ls.hidden), placement or CPU, world)
        return R2d2(net, R2d2Settings(n_step=ls.n_step, gamma=ls.gamma, lr=ls.lr, burn_in=ls.burn_in,
                                      target_update_interval=ls.target_update_interval))

    def make_policy(self, weights: Mapping[str, Any], env: EnvInfo, s: ActorSettings) -> RecurrentPolicy:
        """The recurrent Q-network the published weights fit (its size read from them).

        Raises:
            ConfigError: the weights are not such a network for this environment.
        """
        net = RecurrentQ(env.obs_shape[0], env.num_actions, max(published_hidden(weights, (1,))[-1], 1))
        check_fits(net, weights, s, env, "an R2D2 network", "with --algo r2d2")
        policy = RecurrentPolicy(net, s)
        policy.load(network_weights(weights))
        return policy

    def greedy(self, module: nn.Module) -> Any:
        """argmax_a Q(o, a) of the recurrent network, its state kept between calls (one
        evaluation: every env starts an episode at the first call)."""
        assert isinstance(module, RecurrentQ)
        held: list[State] = []

        def act(obs: torch.Tensor) -> np.ndarray:
            if not held:
                held.append(module.initial_state(obs.shape[0], obs.device))
            q, held[0] = module(obs[:, None], held[0])
            return q[:, 0].argmax(-1).cpu().numpy()

        return act


R2D2 = R2d2Algorithm()
