"""Sampled windows as n-step transitions, gathered in one compiled pass: only what a
transition needs (``o_0``, ``a_0``, the rewards and discounts inside the window, ``o_m``),
with the formulas of :mod:`shardreplay.buffer.nstep`. ``bootstrap_discount`` already holds
``gamma``: never multiply it by ``gamma`` again."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shardreplay.buffer import nstep
from shardreplay.buffer.nstep import Observation, Transitions, _check_gamma, _check_n, _ends, nstep_returns
from shardreplay.errors import SpecMismatchError
from shardreplay.kernels.codes import numba_takes
from shardreplay.kernels.lazy import lazy
from shardreplay.samplers.uniform import UniformSampler
from shardreplay.storage.streams import _nbytes

if TYPE_CHECKING:
    from shardreplay.buffer.shard import Shard
    from shardreplay.kernels import transitions as transition_kernels
    from shardreplay.storage import StreamStorage
else:  # numba loads on the first compiled call, not on import (kernels/lazy.py)
    transition_kernels = lazy("shardreplay.kernels.transitions")

__all__ = ["sample_transitions"]


def sample_transitions(shard: Shard, batch_size: int, gamma: float, n: int | None = None, *,
                       observation: str = "obs", action: str = "action",
                       reward: str = "reward") -> Transitions:
    """:meth:`ReplayBuffer.sample_transitions` of a buffer's ``shard``: its arguments,
    results and errors (ConfigError, SpecMismatchError, EmptyBufferError)."""
    if type(gamma) is not float or not 0.0 <= gamma <= 1.0:  # the common case checked inline
        _check_gamma(gamma)
    n = _check_n(n, shard.window)
    plan = _plan_of(shard, observation, action, reward, n)
    starts, weights = _draw(shard, batch_size)
    if plan.params is None:
        return _sample_in_steps(shard._storage, plan, starts, weights, gamma, n)
    return _sample_compiled(shard._storage, plan, starts, weights, gamma)


_FLOAT32 = np.dtype(np.float32)


@dataclass(frozen=True)
class _Plan:
    """What :func:`sample_transitions` resolves once per storage and names: the checked
    names, and for the compiled path the kernel's parameters and where each gathered
    field comes from."""

    observation: str
    action: str
    reward: str
    obs_names: tuple[str, ...]
    # The compiled path (None: the path in steps): params (kernels/transitions.py), the
    # float dtype of the return, the gathered fields' sources and (name, dtype, shape).
    params: np.ndarray | None = None
    float_dtype: np.dtype = _FLOAT32
    obs_src: np.ndarray | None = None
    act_src: np.ndarray | None = None
    obs_field: tuple[np.dtype, tuple[int, ...]] | None = None
    act_field: tuple[np.dtype, tuple[int, ...]] | None = None
    # Per batch size: (params with the output blocks, output bytes).
    layouts: dict[int, tuple[np.ndarray, int, tuple[Any, ...]]] = field(default_factory=dict)


_ALIGN = 64  # each gathered field's output block starts on a cache line


def _plan_of(shard: Shard, observation: str, action: str, reward: str, n: int) -> _Plan:
    """The plan of these names, kept by the storage (whose arrays are fixed for its life),
    checked, and raising, on the first call only."""
    plans = shard._storage.transition_plans
    key = (observation, action, reward, n)
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = _new_plan(shard, observation, action, reward, n)
    return plan


def _new_plan(shard: Shard, observation: str, action: str, reward: str, n: int) -> _Plan:
    spec = shard.spec
    obs_names = tuple(nstep.observation_names(spec.names, observation, "the buffer's spec"))
    for name in (action, reward):
        if name not in spec:
            raise SpecMismatchError(f"the buffer's spec has no field {name!r}; it has "
                                    f"{sorted(spec.fields)}")
    if spec[reward].frame_stack:
        raise SpecMismatchError(f"reward field {reward!r} is frame-stacked; a reward must be a plain field")
    storage = shard._storage
    rewards = storage.fields[reward]
    plan = _Plan(observation, action, reward, obs_names)
    if rewards.ndim != 1 or not numba_takes(rewards.dtype):
        return plan  # a reward with a shape (or of a dtype numba does not take): in steps
    params = np.zeros(transition_kernels.PARAMS, np.int64)
    params[transition_kernels.CAP] = storage.stream_capacity
    params[transition_kernels.WINDOW] = storage.window
    params[transition_kernels.N] = n
    obs = _gathered(storage, observation, params, (0, 1)) \
        if obs_names == (observation,) else None
    act = _gathered(storage, action, params, (2,))
    return replace(plan, params=params,
                   float_dtype=np.dtype(np.float64 if rewards.dtype == np.float64 else np.float32),
                   obs_src=obs[0] if obs else _NO_BYTES, act_src=act[0] if act else _NO_BYTES,
                   obs_field=obs[1] if obs else None, act_field=act[1] if act else None)


_NO_BYTES = np.zeros(0, np.uint8)


def _gathered(storage: StreamStorage, name: str, params: np.ndarray, gathers: tuple[int, ...]
              ) -> tuple[np.ndarray, tuple[np.dtype, tuple[int, ...]]] | None:
    """The source bytes and (dtype, shape) of plain field ``name`` for the kernel's
    ``gathers`` (their stride, offset and size set in ``params``), or None for a field
    read in steps (frame-stacked, no bytes, a dtype numba does not take)."""
    f = storage.spec[name]
    if name in storage.stacked or _nbytes(f.dtype, f.shape) == 0:
        return None
    rows, offset, size = storage._byte_source(name)  # C-contiguous uint8 rows, memmaps too
    for g in gathers:
        at = transition_kernels.GATHER + g * transition_kernels.GATHER_WORDS
        params[at + transition_kernels.STRIDE] = rows.shape[1]
        params[at + transition_kernels.OFFSET] = offset
        params[at + transition_kernels.BYTES] = size
    return rows.reshape(-1), (np.dtype(f.dtype), tuple(f.shape))


def _draw(shard: Shard, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Window starts and their weights: ``shard.draw``'s, with a uniform sampler's starts
    drawn alone (the same draws; its probabilities are not needed here)."""
    sampler = shard._sampler
    if type(sampler) is UniformSampler and type(batch_size) is int and batch_size >= 1 \
            and sampler.storage.num_valid > 0:
        return sampler.draw_starts(batch_size, shard.rng), np.ones(batch_size, np.float32)
    draw = shard.draw(batch_size)  # the checks and errors, and every other sampler
    return draw.starts, draw.weights


# Where a gathered field lies in the output bytes: (start, stop, dtype, [B, *shape]).
_Block = tuple[int, int, np.dtype, tuple[int, ...]]


def _layout(plan: _Plan, batch: int) -> tuple[np.ndarray, int, tuple[_Block | None, ...]]:
    """The kernel's params for ``batch`` transitions (each gathered field's output block),
    the output bytes and each gathered field's block, cached per batch size."""
    got = plan.layouts.get(batch)
    if got is None:
        assert plan.params is not None
        params = plan.params.copy()
        total = 0
        blocks: list[_Block | None] = []
        for g, f in enumerate((plan.obs_field, plan.obs_field, plan.act_field)):
            at = transition_kernels.GATHER + g * transition_kernels.GATHER_WORDS
            size = int(params[at + transition_kernels.BYTES]) * batch
            params[at + transition_kernels.DST] = total
            blocks.append(None if f is None else (total, total + size, f[0], (batch, *f[1])))
            total += -(-size // _ALIGN) * _ALIGN
        got = plan.layouts[batch] = (params, total, tuple(blocks))
    return got


def _block(dst: np.ndarray, block: _Block) -> torch.Tensor:
    start, stop, dtype, shape = block
    return torch.from_numpy(dst[start:stop].view(dtype).reshape(shape))


def _sample_compiled(storage: StreamStorage, plan: _Plan, starts: np.ndarray, weights: np.ndarray,
                     gamma: float) -> Transitions:
    """The transitions of ``starts`` in one compiled call (kernels/transitions.py)."""
    batch = starts.shape[0]
    params, total, (obs_block, next_block, act_block) = _layout(plan, batch)
    # The key epoch and tag change on a restore: read each time.
    params[transition_kernels.EPOCH] = storage.key_epoch
    params[transition_kernels.TAG] = storage.key_tag
    floats = np.empty((2, batch), plan.float_dtype)
    ints = np.empty((3, batch), np.int64)
    flags = np.empty((2, batch), np.bool_)
    dst = np.empty(total, np.uint8)
    transition_kernels.scalar_transitions(starts, storage.step_type, storage.discount, storage.generation,
                                          storage.fields[plan.reward], params, float(gamma), floats, ints,
                                          flags, plan.obs_src, plan.act_src, dst)
    obs: Observation
    next_obs: Observation
    if obs_block is not None and next_block is not None:
        obs, next_obs = _block(dst, obs_block), _block(dst, next_block)
    else:
        obs, next_obs = _observations(storage, plan, starts, ints[1])
    act = _block(dst, act_block) if act_block is not None else \
        torch.from_numpy(_steps_of(storage, plan.action, starts))
    return Transitions(obs=obs, action=act, reward=torch.from_numpy(floats[0]), next_obs=next_obs,
                       bootstrap_discount=torch.from_numpy(floats[1]), weights=torch.from_numpy(weights),
                       keys=torch.from_numpy(ints[2]), num_steps=torch.from_numpy(ints[0]),
                       terminated=torch.from_numpy(flags[0]), truncated=torch.from_numpy(flags[1]))


def _observations(storage: StreamStorage, plan: _Plan, first: np.ndarray, last: np.ndarray
                  ) -> tuple[Observation, Observation]:
    """The observations at ``first`` and ``last`` read in steps (one field, or a dict of
    nested ones)."""
    if plan.obs_names == (plan.observation,):
        return (torch.from_numpy(_steps_of(storage, plan.observation, first)),
                torch.from_numpy(_steps_of(storage, plan.observation, last)))
    return ({k: torch.from_numpy(_steps_of(storage, k, first)) for k in plan.obs_names},
            {k: torch.from_numpy(_steps_of(storage, k, last)) for k in plan.obs_names})


def _sample_in_steps(storage: StreamStorage, plan: _Plan, starts: np.ndarray, weights: np.ndarray,
                     gamma: float, n: int) -> Transitions:
    """The transitions of ``starts`` for a reward the compiled path does not take (one with a
    shape, or of a dtype numba does not take): :func:`nstep_returns` over ``n + 1`` steps."""
    idx, mask, keys = storage.window_indices(starts)
    cut = idx[:, :n + 1]
    rewards = storage.fields[plan.reward][cut]
    returns, boot, m = nstep_returns(torch.from_numpy(rewards), torch.from_numpy(storage.discount[cut]),
                                     torch.from_numpy(mask[:, :n + 1]), gamma, validate=False)
    last = cut[np.arange(cut.shape[0]), m.numpy()]
    obs, next_obs = _observations(storage, plan, starts, last)
    ends = _ends(torch.from_numpy(storage.step_type[last]), torch.from_numpy(storage.discount[last]))
    return Transitions(obs=obs, action=torch.from_numpy(_steps_of(storage, plan.action, starts)),
                       reward=returns, next_obs=next_obs, bootstrap_discount=boot,
                       weights=torch.from_numpy(weights), keys=torch.from_numpy(keys), num_steps=m, **ends)


def _steps_of(storage: StreamStorage, name: str, slots: np.ndarray) -> np.ndarray:
    """Field ``name`` of the steps at flat ``slots``: a frame-stacked field's stacks are
    rebuilt from its frames, a plain field is read by index."""
    store = storage.stacked.get(name)
    return store.gather(slots) if store is not None else storage.fields[name][slots]

