"""Double DQN with n-step returns and prioritized replay, on sampled windows.

::

    a*     = argmax_a Q_online(o_m, a)
    target = R + gamma_m * Q_target(o_m, a*)         (gamma_m = 0 after a termination)
    td     = target - Q_online(o_0, a_0)
    loss   = mean_b( w_b * huber(td_b) )             (w: importance weights)

New priorities are ``|td| + priority_eps``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardreplay.buffer.batch import Batch
from shardreplay.buffer.nstep import nstep_transitions
from shardreplay.errors import ConfigError


@dataclass(frozen=True)
class DqnSettings:
    """Learning settings (documented in ``shardreplay train --help``)."""

    gamma: float = 0.99
    lr: float = 2.3e-3
    grad_clip: float = 10.0
    target_update_interval: int = 10
    tau: float = 1.0
    priority_eps: float = 1e-3


class DoubleDqn:
    """Online and target Q-networks, the optimizer, and one learning step.

    Args:
        online: the Q-network that learns (may be wrapped in DDP).
        settings: learning settings.
    """

    def __init__(self, online: nn.Module, settings: DqnSettings) -> None:
        self.online = online
        self.target = copy.deepcopy(_unwrap(online)).requires_grad_(False)
        self.settings = settings
        self.optimizer = torch.optim.Adam(online.parameters(), lr=settings.lr)
        self.updates = 0

    @property
    def module(self) -> nn.Module:
        """The bare Q-network (without DDP)."""
        return _unwrap(self.online)

    def learn(self, batch: Batch) -> tuple[torch.Tensor, float]:
        """One gradient step on ``batch``; returns (new priorities ``[B]``, loss).

        A padding batch (an empty shard in local mode: weights 0, well-formed windows)
        takes the normal path, so DDP sees the same forward and backward on every rank.

        Raises:
            ConfigError: the batch's observations are nested (a dict), not one tensor.
        """
        s = self.settings
        tr = nstep_transitions(batch, s.gamma, validate=False)
        if not isinstance(tr.observation, torch.Tensor) or not isinstance(tr.next_observation, torch.Tensor):
            raise ConfigError("DoubleDqn learns from flat observations (one tensor), not nested ones")
        obs = tr.observation.float()
        next_obs = tr.next_observation.float()
        q = self.online(obs).gather(1, tr.action.long().reshape(-1, 1)).squeeze(1)
        with torch.no_grad():
            best = self.online(next_obs).argmax(dim=1, keepdim=True)
            bootstrap = self.target(next_obs).gather(1, best).squeeze(1)
            target = tr.reward.float() + tr.bootstrap_discount.float() * bootstrap
        td = target - q
        loss = (batch.weights.float() * F.smooth_l1_loss(q, target, reduction="none")).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.online.parameters(), s.grad_clip)
        self.optimizer.step()
        self._after_step()
        return td.detach().abs() + s.priority_eps, float(loss.detach())

    def _after_step(self) -> None:
        """Count the update; move the target network (a copy every
        ``target_update_interval`` updates, blended by ``tau``: 1 is a hard copy)."""
        self.updates += 1
        if self.updates % self.settings.target_update_interval:
            return
        tau = self.settings.tau
        with torch.no_grad():
            for t, o in zip(self.target.parameters(), self.module.parameters(), strict=True):
                t.mul_(1.0 - tau).add_(o, alpha=tau)

    def state_dict(self) -> dict[str, object]:
        """Online, target and optimizer state, and the update count."""
        return {"online": self.module.state_dict(), "target": self.target.state_dict(),
                "optimizer": self.optimizer.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Inverse of :meth:`state_dict`."""
        self.module.load_state_dict(state["online"])  # type: ignore[arg-type]
        self.target.load_state_dict(state["target"])  # type: ignore[arg-type]
        self.optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
        self.updates = int(state["updates"])  # type: ignore[call-overload]


def _unwrap(module: nn.Module) -> nn.Module:
    return module.module if hasattr(module, "module") and isinstance(module.module, nn.Module) else module
