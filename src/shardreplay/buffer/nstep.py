"""Sampled windows as n-step transitions: :class:`Transitions`, the formulas, and
:func:`nstep_transitions` of any :class:`Batch` (``sample_transitions``' compiled gather of
the same numbers: buffer/transitions.py). The formulas and timelines: docs/semantics.md,
"Transitions"."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from shardreplay.buffer.batch import Batch
from shardreplay.errors import ConfigError, SpecMismatchError
from shardreplay.spec.fields import StepType

__all__ = ["Transitions", "nstep_returns", "nstep_transitions"]

Observation = torch.Tensor | dict[str, torch.Tensor]
INSTALL = "pip install 'shardreplay[tensordict]' (or tensordict itself)"


@dataclass(frozen=True)
class Transitions:
    """A batch of ``B`` n-step transitions, as torch tensors (CPU from ``sample_transitions``,
    on the batch's device from :func:`nstep_transitions`).

    Attributes:
        obs: ``o_0`` ``[B, *obs_shape]`` (a dict by dotted name for nested observations).
        action: ``a_0`` ``[B, *action_shape]``, in the stored dtype.
        reward: the discounted n-step return ``R`` ``[B, *reward_shape]``, float32 (or
            float64 for a float64 reward field).
        next_obs: ``o_m``, the observation to bootstrap from, like ``obs``.
        bootstrap_discount: ``gamma^m * prod d_i`` ``[B]``, same dtype as ``reward``:
            gamma is applied already, and it is 0 after a termination. The TD target is
            ``reward + bootstrap_discount * V(next_obs)``.
        weights: importance weights float32 ``[B]`` (all ones unless prioritized).
        keys: int64 ``[B]``, for :meth:`ReplayBuffer.update_priorities`.
        num_steps: ``m``, int64 ``[B]``: how many rewards ``reward`` sums (1 .. n).
        terminated: bool ``[B]``, ``o_m`` ends its episode by a termination (LAST with
            discount 0); None where not known (built by hand).
        truncated: bool ``[B]``, ``o_m`` ends its episode by a truncation; None likewise.
    """

    obs: Observation
    action: torch.Tensor
    reward: torch.Tensor
    next_obs: Observation
    bootstrap_discount: torch.Tensor
    weights: torch.Tensor
    keys: torch.Tensor
    num_steps: torch.Tensor
    terminated: torch.Tensor | None = None
    truncated: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    def to_tensordict(self) -> Any:
        """These transitions as a ``tensordict.TensorDict`` with TorchRL's names (docs/porting.md,
        "From the other libraries"), which a TorchRL loss built with the same gamma takes
        unchanged.

        Raises:
            ConfigError: the tensordict package is not installed.
        """
        try:
            from tensordict import TensorDict
        except ImportError as exc:
            raise ConfigError("as_tensordict / to_tensordict need the tensordict package: "
                              f"{INSTALL}") from exc
        batch = len(self)
        boot = self.bootstrap_discount
        terminated = self.terminated if self.terminated is not None else boot == 0
        truncated = self.truncated if self.truncated is not None else torch.zeros_like(terminated)

        def col(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(batch, 1)

        reward = self.reward.unsqueeze(-1) if self.reward.dim() == 1 else self.reward
        return TensorDict({
            "observation": _as_tensordict(self.obs, batch),
            "action": self.action,
            "next": TensorDict({"observation": _as_tensordict(self.next_obs, batch), "reward": reward,
                                "done": col(terminated | truncated), "terminated": col(terminated),
                                "truncated": col(truncated)}, batch_size=[batch]),
            "steps_to_next_obs": col(self.num_steps),
            "bootstrap_discount": boot,
            "priority_weight": self.weights,
            "index": self.keys,
        }, batch_size=[batch], device=self.keys.device)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Transitions:
        """A copy with every tensor on ``device`` (``keys`` too: update_priorities takes them
        back from any device)."""
        def move(x: Any) -> Any:
            if isinstance(x, dict):
                return {k: v.to(device, non_blocking=non_blocking) for k, v in x.items()}
            return None if x is None else x.to(device, non_blocking=non_blocking)

        return Transitions(**{f.name: move(getattr(self, f.name)) for f in fields(self)})


def _as_tensordict(obs: Observation, batch: int) -> Any:
    """An observation tensor, or nested fields ``"obs.a.b"`` as nested TensorDicts."""
    if isinstance(obs, torch.Tensor):
        return obs
    from tensordict import TensorDict

    out = TensorDict({}, batch_size=[batch])
    for name, value in obs.items():
        out.set(tuple(name.split(".")[1:]), value)
    return out


def nstep_returns(reward: torch.Tensor, discount: torch.Tensor, mask: torch.Tensor, gamma: float,
                  *, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n-step returns and bootstrap discounts of ``B`` windows of length ``L``.

    Args:
        reward: ``[B, L, *reward_shape]``, ``r_t`` at step ``t``.
        discount: ``[B, L]``, ``d_t`` of step ``t``.
        mask: bool ``[B, L]``: True up to the window's bootstrap step, False on padding
            after it (a prefix of Trues starting at position 0).
        gamma: discount factor in ``[0, 1]``.
        validate: check the mask's values (a device synchronisation on GPU); shapes,
            dtypes and ``gamma`` are always checked.

    Returns:
        ``(R, gamma_m, m)``: returns ``[B, *reward_shape]`` (floating, at least
        float32), bootstrap discounts ``[B]`` in the same dtype, and the bootstrap
        positions ``m`` (int64 ``[B]``, 1 .. L-1).

    Raises:
        ConfigError: ``gamma`` outside ``[0, 1]`` or ``L < 2``.
        SpecMismatchError: mismatched shapes or dtypes, or a mask that is not a prefix
            of at least two Trues.
    """
    _check_gamma(gamma)
    batch_size, length = _check_window(mask, validate)
    if reward.shape[:2] != (batch_size, length) or discount.shape != (batch_size, length):
        raise SpecMismatchError(f"reward {tuple(reward.shape)} and discount {tuple(discount.shape)} "
                                f"must start with the mask's shape {(batch_size, length)}")
    dtype = torch.promote_types(reward.dtype, torch.float32) if reward.is_floating_point() \
        else torch.float32
    m = mask.sum(dim=1) - 1
    positions = torch.arange(length, device=mask.device)
    # c_k = prod_{i=1..k} d_i: d_0 is the discount into s_0, outside this window.
    d = discount.to(dtype)
    c = torch.cumprod(torch.cat([torch.ones_like(d[:, :1]), d[:, 1:]], dim=1), dim=1)
    g = torch.pow(torch.tensor(gamma, dtype=dtype, device=d.device), positions.to(dtype))
    summed = positions[None, :] < m[:, None]
    factor = g[None, :] * c
    extra = (1,) * (reward.dim() - 2)
    # where(), not a product with 0: padding rewards may be NaN or inf.
    terms = torch.where(summed.view(batch_size, length, *extra),
                        factor.view(batch_size, length, *extra) * reward.to(dtype),
                        torch.zeros((), dtype=dtype, device=d.device))
    returns = terms.sum(dim=1)
    bootstrap = factor.gather(1, m[:, None]).squeeze(1)
    return returns, bootstrap, m


def nstep_transitions(batch: Batch, gamma: float, n: int | None = None, *, observation: str = "obs",
                      action: str = "action", reward: str = "reward", validate: bool = True) -> Transitions:
    """The n-step transitions of a batch of windows (any buffer, any device): the same
    numbers as ``ReplayBuffer.sample_transitions`` for the same windows, with the
    batch's keys and weights.

    Args:
        batch: sampled windows ``[B, L, ...]`` with ``step_type``, ``discount`` and the
            named fields in ``batch.data``.
        gamma: discount factor in ``[0, 1]``.
        n: steps summed at most (default ``L - 1``); ``n < L - 1`` uses the first
            ``n + 1`` steps of each window.
        observation: name of the observation field; a prefix such as ``"obs"`` of
            nested fields ``"obs.pos"``, ``"obs.vel"`` gives dicts keyed by full name.
        action: name of the action field.
        reward: name of the reward field.
        validate: check that the mask and step types agree (two device
            synchronisations on GPU); turn off in a hot loop once the data is trusted.

    Raises:
        ConfigError: ``gamma`` outside ``[0, 1]``, windows shorter than 2, or ``n``
            outside ``1 .. L - 1``.
        SpecMismatchError: a named field is missing or has the wrong shape, the mask is
            not a prefix, or the step types disagree with the mask (a LAST before the
            bootstrap step, or a masked window whose bootstrap step is not LAST).
    """
    if n is not None and _check_n(n, int(batch.mask.shape[1])) + 1 < batch.mask.shape[1]:
        batch = Batch(data={k: v[:, :n + 1] for k, v in batch.data.items()}, mask=batch.mask[:, :n + 1],
                      keys=batch.keys, weights=batch.weights, probabilities=batch.probabilities)
    data = batch.data
    for name in (action, reward, "step_type", "discount"):
        if name not in data:
            raise SpecMismatchError(f"batch has no field {name!r}; it has {sorted(data)}")
    returns, bootstrap, m = nstep_returns(data[reward], data["discount"], batch.mask, gamma,
                                          validate=validate)
    if validate:
        _check_step_types(data["step_type"], batch.mask, m)
    rows = torch.arange(len(m), device=m.device)
    obs = _select(data, observation, batch.mask.shape)
    return Transitions(
        obs={k: v[:, 0] for k, v in obs.items()} if isinstance(obs, dict) else obs[:, 0],
        action=_field(data, action, batch.mask.shape)[:, 0],
        reward=returns,
        next_obs={k: v[rows, m] for k, v in obs.items()} if isinstance(obs, dict) else obs[rows, m],
        bootstrap_discount=bootstrap, weights=batch.weights, keys=batch.keys, num_steps=m,
        **_ends(data["step_type"][rows, m], data["discount"][rows, m]))


def _ends(step_type: torch.Tensor, discount: torch.Tensor) -> dict[str, torch.Tensor]:
    """``terminated`` and ``truncated`` of the bootstrap steps (their step types and
    discounts): a LAST with discount 0 terminates, a LAST with another one truncates."""
    is_last = step_type == int(StepType.LAST)
    return {"terminated": is_last & (discount == 0), "truncated": is_last & (discount != 0)}


def _check_n(n: Any, window: int) -> int:
    if n is None:
        n = window - 1
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or not 1 <= n <= window - 1:
        raise ConfigError(f"n must be an integer in [1, {window - 1}] for windows of {window} steps "
                          f"(make the buffer with window = n + 1), got {n!r}")
    return int(n)


def _check_gamma(gamma: float) -> None:
    # numbers.Real: numpy scalars such as np.float32 are valid gammas too.
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real) or \
            not math.isfinite(gamma) or not 0.0 <= gamma <= 1.0:
        raise ConfigError(f"gamma must be a number in [0, 1], got {gamma!r}")


def _check_window(mask: torch.Tensor, validate: bool) -> tuple[int, int]:
    if mask.dtype != torch.bool or mask.dim() != 2:
        raise SpecMismatchError(f"mask must be a bool tensor [B, L], got {mask.dtype} "
                                f"{tuple(mask.shape)}")
    batch_size, length = mask.shape
    if length < 2:
        raise ConfigError(f"n-step transitions need windows of length L = n + 1 >= 2, got L = "
                          f"{length}: make the buffer with window >= 2")
    if validate and batch_size and not (mask[:, :2].all() and (mask[:, 1:] <= mask[:, :-1]).all()):
        raise SpecMismatchError("mask must be True on positions 0 and 1 and stay False after its "
                                "first False (padding only after the window's LAST)")
    return batch_size, length


def _check_step_types(step_type: torch.Tensor, mask: torch.Tensor, m: torch.Tensor) -> None:
    batch_size, length = mask.shape
    if step_type.shape != mask.shape:
        raise SpecMismatchError(f"step_type must be [B, L] = {tuple(mask.shape)}, got "
                                f"{tuple(step_type.shape)}")
    is_last = step_type == int(StepType.LAST)
    positions = torch.arange(length, device=m.device)
    if (is_last & (positions[None, :] < m[:, None])).any():
        raise SpecMismatchError("a window holds a LAST before its last valid step: the mask "
                                "must be False after a LAST")
    rows = torch.arange(batch_size, device=m.device)
    if (~is_last[rows, m] & (m < length - 1)).any():
        raise SpecMismatchError("a window ends early (mask False) without a LAST at its last "
                                "valid step")


def _field(data: dict[str, torch.Tensor], name: str, lead: torch.Size) -> torch.Tensor:
    value = data.get(name)
    if value is None:
        raise SpecMismatchError(f"batch has no field {name!r}; it has {sorted(data)}")
    if value.shape[:2] != lead:
        raise SpecMismatchError(f"field {name!r} must start with {tuple(lead)}, got "
                                f"{tuple(value.shape)}")
    return value


def _select(data: dict[str, torch.Tensor], name: str, lead: torch.Size) -> Observation:
    names = observation_names(data, name, "batch")
    return _field(data, name, lead) if names == [name] else {k: _field(data, k, lead) for k in names}


def observation_names(names: Iterable[str], observation: str, owner: str) -> list[str]:
    """``[observation]`` when ``names`` has it, else its nested fields ``observation.*``;
    raises SpecMismatchError (naming ``owner``, what has the ``names``) when neither."""
    names = list(names)
    if observation in names:
        return [observation]
    nested = [k for k in names if k.startswith(observation + ".")]
    if not nested:
        raise SpecMismatchError(f"{owner} has no observation field {observation!r} (nor "
                                f"{observation + '.*'}); it has {sorted(names)}")
    return nested
