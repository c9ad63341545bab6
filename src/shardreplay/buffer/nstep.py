"""Turn sampled windows into n-step transitions.

A window of ``L = n + 1`` steps ``s_0 .. s_n`` of one stream becomes one transition
``(o_0, a_0, R, gamma_m, o_m)``. Step ``t`` holds ``o_t``, the action ``a_t`` taken at
it, the reward ``r_t`` that followed ``a_t``, and the discount ``d_t`` of step ``t``
(0 at a termination LAST, 1 at a truncation LAST and elsewhere; dm_env allows values
in between). The **bootstrap step** ``m`` is the window's last valid position: ``n``
for a full window, or the LAST inside it. ``m >= 1`` because a window never starts at
a LAST.

Formulas (``prod`` over an empty range is 1)::

    R     = sum_{k=0}^{m-1} gamma^k * (prod_{i=1}^{k} d_i) * r_k
    gamma_m = gamma^m * prod_{i=1}^{m} d_i        (the "bootstrap discount")

The learner's target is ``R + gamma_m * V(o_m)``. The rewards ``r_m .. r_n`` are never
summed: at a LAST ``r_m`` follows a padding action, and in a full window ``r_n``
belongs to the next transition.

Timelines for ``n = 3`` (``L = 4``), ``g = gamma``::

    full window        s0 ---- s1 ---- s2 ---- s3        m = 3
                          r0      r1      r2             R = r0 + g r1 + g^2 r2
                                                         gamma_m = g^3 (d all 1)

    termination at 2   s0 ---- s1 ---- s2:LAST  [pad]   m = 2, d2 = 0
                          r0      r1                     R = r0 + g r1
                                                         gamma_m = g^2 * 0 = 0

    truncation at 2    s0 ---- s1 ---- s2:LAST  [pad]   m = 2, d2 = 1
                          r0      r1                     R = r0 + g r1
                                                         gamma_m = g^2, from o2

With 0/1 discounts only the LAST step can carry a 0, and it is the bootstrap step, so
``R`` is the plain discounted sum and ``gamma_m`` is ``gamma^m`` or 0.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from shardreplay.buffer.batch import Batch
from shardreplay.errors import ConfigError, SpecMismatchError
from shardreplay.spec.fields import StepType

__all__ = ["NStepTransition", "nstep_returns", "nstep_transitions"]

Observation = torch.Tensor | dict[str, torch.Tensor]


@dataclass(frozen=True)
class NStepTransition:
    """A batch of ``B`` n-step transitions (see the module docstring for the formulas).

    Attributes:
        observation: ``o_0``, ``[B, *obs_shape]``; a dict of such tensors (by dotted
            name) when the observation is a nested field.
        action: ``a_0``, ``[B, *action_shape]``.
        reward: ``R``, ``[B, *reward_shape]``, the discounted sum of ``r_0 .. r_{m-1}``.
        bootstrap_discount: ``gamma^m * prod_{i=1..m} d_i``, ``[B]``; 0 after a
            termination.
        next_observation: ``o_m``, the observation at the bootstrap step, like
            ``observation``.
        num_steps: ``m``, int64 ``[B]``: the number of rewards summed (1 .. n).
    """

    observation: Observation
    action: torch.Tensor
    reward: torch.Tensor
    bootstrap_discount: torch.Tensor
    next_observation: Observation
    num_steps: torch.Tensor


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


def nstep_transitions(batch: Batch, gamma: float, *, observation: str = "obs",
                      action: str = "action", reward: str = "reward",
                      validate: bool = True) -> NStepTransition:
    """The n-step transitions of a batch of windows (``n = L - 1``).

    Args:
        batch: sampled windows ``[B, L, ...]`` with ``step_type``, ``discount`` and the
            named fields in ``batch.data``.
        gamma: discount factor in ``[0, 1]``.
        observation: name of the observation field; a prefix such as ``"obs"`` of
            nested fields ``"obs.pos"``, ``"obs.vel"`` gives dicts keyed by full name.
        action: name of the action field.
        reward: name of the reward field.
        validate: check that the mask and step types agree (two device
            synchronisations on GPU); turn off in a hot loop once the data is trusted.

    Returns:
        The transitions; see :class:`NStepTransition`.

    Raises:
        ConfigError: ``gamma`` outside ``[0, 1]`` or windows shorter than 2.
        SpecMismatchError: a named field is missing or has the wrong shape, the mask is
            not a prefix, or the step types disagree with the mask (a LAST before the
            bootstrap step, or a masked window whose bootstrap step is not LAST).
    """
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
    return NStepTransition(
        observation={k: v[:, 0] for k, v in obs.items()} if isinstance(obs, dict) else obs[:, 0],
        action=_field(data, action, batch.mask.shape)[:, 0],
        reward=returns,
        bootstrap_discount=bootstrap,
        next_observation=({k: v[rows, m] for k, v in obs.items()} if isinstance(obs, dict)
                          else obs[rows, m]),
        num_steps=m,
    )


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
    if name in data:
        return _field(data, name, lead)
    nested = {k: _field(data, k, lead) for k in data if k.startswith(name + ".")}
    if not nested:
        raise SpecMismatchError(f"batch has no observation field {name!r} (nor {name + '.*'}); "
                                f"it has {sorted(data)}")
    return nested
