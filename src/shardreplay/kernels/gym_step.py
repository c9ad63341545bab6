"""The compiled write of a gymnasium vector env's step (gym/writer.py holds the
writer): every env's held step into the storage and its bookkeeping, in one call.

As the one-step add (``kernels/add_step.py``), it is shaped for numba's dispatcher, since
the call is most of the cost of one small step: the per-slot records come as plain
``uint8`` rows (numba types a structured array off its fast path), the positions and
counters as one array, the result is one integer, and it is compiled without numba's
reference counting where numba has that option (it allocates nothing and keeps no array).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba.core.cpu import CPUTargetOptions
from numba.extending import overload

from shardreplay.kernels import cache_lock  # noqa: F401  (numba's cache, safe across processes)
from shardreplay.kernels.copy import copy_at
from shardreplay.kernels.storage import write_steps

FIRST, MID, LAST = 0, 1, 2
# The int64 state array's header: the ring, the window, same_step, whether obs, action and
# reward must be finite, steps written, episodes ended, ``write_steps``'s n of the last
# write; the byte offsets of the bookkeeping in a record. HELD: where the held step types start.
CAP, WINDOW, SAME_STEP, FINITE_OBS, FINITE_ACTION, FINITE_REWARD, STEPS, EPISODES, N_OUT = range(9)
AT_STEP_TYPE, AT_DISCOUNT, AT_EPISODE, AT_GENERATION, AT_PRIORITY, AT_VALID = range(9, 15)
HELD = 15
RECORD_PARTS = ("step_type", "discount", "episode_id", "generation", "priority", "valid")  # AT_* order
# What a refused input returns (any change in the number of valid starts is far smaller):
# FAILED - k, k = 1 .. 3 for NaN or inf in the obs, action or reward of a finite field,
# 4 for an input of the wrong shape.
FAILED = -(1 << 62)
_NO_PRIORITIES = np.zeros((1, 1), np.float32)
# The same bookkeeping as every other write, inlined here (and so compiled without
# reference counting too).
_write_steps = numba.njit(nogil=True, inline="always")(write_steps.py_func)
_OPTIONS: dict[str, Any] = {"cache": True, "nogil": True,
                            **({"_nrt": False} if hasattr(CPUTargetOptions, "_nrt") else {})}


@numba.njit(**_OPTIONS)
def _all_finite(values):  # pragma: no cover - compiled
    """No NaN or inf among ``values`` (any layout: no copy)."""
    for v in np.nditer(values):  # noqa: SIM110 - a loop numba compiles (no generators)
        if not np.isfinite(v.item()):
            return False
    return True


@numba.njit(**_OPTIONS)  # not inlined: numba mis-scopes the loop variables of an inlined loop
def _flat_copy(dst, src):  # pragma: no cover - compiled
    """``dst[...] = src`` element by element (as many elements; any layouts, casting as
    numba's assignment does), without the copy numba's array assignment makes of a source
    that may overlap its destination (an allocation)."""
    out = dst.flat
    k = 0
    for v in src.flat:
        out[k] = v
        k += 1  # noqa: SIM113 - a loop numba compiles (flat iterators do not enumerate)


@numba.njit(**_OPTIONS)
def _dense(a):  # pragma: no cover - compiled
    """Whether ``a``'s elements lie in C order without gaps (``a.flags`` would need
    numba's reference counting)."""
    expected = a.itemsize
    for d in range(a.ndim - 1, -1, -1):
        if a.shape[d] != 1 and a.strides[d] != expected:
            return False
        expected *= a.shape[d]
    return True


def _put(store, slot, src, i):  # pragma: no cover - compiled
    """``store[slot] = src[i]``, allocating nothing."""
    raise NotImplementedError("compiled only")


@overload(_put, inline="always")
def _put_compiled(store, slot, src, i):  # pragma: no cover - compiling
    if store.ndim == 1:  # a scalar field
        def scalar(store, slot, src, i):
            store[slot] = src[i]
        return scalar
    if store.dtype == src.dtype:
        def same(store, slot, src, i):
            dst, row = store[slot], src[i]
            if _dense(dst) and _dense(row):
                copy_at(dst, 0, row, 0, row.size * row.itemsize)
            else:
                _flat_copy(dst, row)
        return same

    def cast(store, slot, src, i):
        _flat_copy(store[slot], src[i])
    return cast


@numba.njit(**_OPTIONS)
def _book(records, pos_and_counters, state, fstate):  # pragma: no cover - compiled
    """The part of :func:`gym_write` that no input's type changes: the bookkeeping of every
    env's held step and its discount; returns the change in valid starts.

    A kernel of its own, not inlined: its signature is the same for every writer, so numba
    compiles it once and each kind of inputs only types the field copies."""
    num_envs = fstate.shape[0] - 1
    types = state[HELD:HELD + num_envs].reshape(num_envs, 1)
    rows = state[HELD + num_envs:HELD + 2 * num_envs]
    out = state[HELD + 2 * num_envs:].reshape(4, num_envs * state[WINDOW])
    # The bookkeeping columns of the records, as strided views.
    episode_id = records[:, state[AT_EPISODE]:state[AT_EPISODE] + 8].view(np.int64)[:, 0]
    generation = records[:, state[AT_GENERATION]:state[AT_GENERATION] + 4].view(np.uint32)[:, 0]
    priority = records[:, state[AT_PRIORITY]:state[AT_PRIORITY] + 4].view(np.float32)[:, 0]
    valid = records[:, state[AT_VALID]:state[AT_VALID] + 1].view(np.bool_)[:, 0]
    disc_store = records[:, state[AT_DISCOUNT]:state[AT_DISCOUNT] + 4].view(np.float32)[:, 0]
    n_out, delta = _write_steps(records[:, state[AT_STEP_TYPE]], episode_id, generation, priority, valid,
                                pos_and_counters[:num_envs], pos_and_counters[num_envs:], rows, types,
                                _NO_PRIORITIES, False, fstate[0], state[CAP], state[WINDOW], out[:2], out[2:])
    state[N_OUT] = n_out
    for i in range(num_envs):
        disc_store[out[0, i]] = fstate[1 + i]
    return delta


def gym_write(records, pos_and_counters, state, fstate, obs_store, act_store, rew_store, held_obs,
              action, obs, reward, terminated, truncated):  # pragma: no cover - compiled
    """Write every env's held step, then hold the new observation, step type and discount.

    ``records`` is the storage's per-slot records as uint8 ``[N, record bytes]``
    (bookkeeping and discount, at the offsets in ``state``); ``pos_and_counters`` the
    storage's positions ``[num_envs]`` then its counters; ``state`` (int64) holds the
    header above, then per env its held step type, then ``0 .. num_envs - 1``, then
    ``out`` ``[4, num_envs * window]``: the written slots (row 0), the recomputed slots
    (row 1), their validity (row 2) and whether each became valid (row 3). ``fstate`` is
    ``[priority of new steps, held discount of each env ...]``. Arguments are few and
    nothing is allocated on purpose: each argument costs the dispatcher time on every step.

    Returns the change in the number of valid starts (``write_steps``'s n left in
    ``state[N_OUT]``), or ``FAILED - k`` with nothing changed (see ``FAILED``)."""
    num_envs = held_obs.shape[0]
    if (obs.shape != held_obs.shape or action.shape[0] != num_envs or action.shape[1:] != act_store.shape[1:]
            or reward.shape[0] != num_envs or terminated.shape[0] != num_envs
            or truncated.shape[0] != num_envs):
        return FAILED - 4
    if state[FINITE_OBS] and not _all_finite(obs):
        return FAILED - 1
    if state[FINITE_ACTION] and not _all_finite(action):
        return FAILED - 2
    if state[FINITE_REWARD] and not _all_finite(reward):
        return FAILED - 3
    delta = _book(records, pos_and_counters, state, fstate)
    out_at = HELD + 2 * num_envs  # row 0 of write_steps' results: the written slots
    same_step = state[SAME_STEP] != 0
    n_done = 0
    for i in range(num_envs):
        slot = state[out_at + i]
        was_last = state[HELD + i] == LAST
        _put(obs_store, slot, held_obs, i)
        if was_last:  # the env ignored this action (NEXT_STEP reset): padding
            act_store[slot] = 0
            rew_store[slot] = 0
        else:
            _put(act_store, slot, action, i)
            rew_store[slot] = reward[i]
        done = terminated[i] or truncated[i]
        n_done += done
        if same_step:
            state[HELD + i] = FIRST if done else MID
            fstate[1 + i] = 1.0
        elif done:
            state[HELD + i] = LAST
            fstate[1 + i] = 0.0 if terminated[i] else 1.0
        else:
            state[HELD + i] = FIRST if was_last else MID
            fstate[1 + i] = 1.0
        _put(held_obs, i, obs, i)
    state[STEPS] += num_envs
    state[EPISODES] += n_done
    return delta


def compiled_gym_write(head: tuple[np.ndarray, ...], inputs: tuple[np.ndarray, ...]) -> Any:
    """A dispatcher of :func:`gym_write` compiled for ``head + inputs`` only, which compiles
    nothing by itself: a call with argument types it was not compiled for raises
    ``TypeError``. The writer adds (compiles, or loads from numba's cache) one signature
    per kind of inputs it accepted, so the types numba reads at dispatch are the whole
    per-call input check."""
    dispatcher = numba.njit(**_OPTIONS)(gym_write)
    dispatcher.compile(tuple(numba.typeof(x) for x in (*head, *inputs)))
    dispatcher.disable_compile()
    return dispatcher


def allow_inputs(dispatcher: Any, args: tuple[np.ndarray, ...]) -> None:
    """Let a :func:`compiled_gym_write` dispatcher take arguments of the types of
    ``args`` from now on (compiled, or loaded from numba's cache, once)."""
    signature = tuple(numba.typeof(x) for x in args)
    if signature not in dispatcher.overloads:
        dispatcher.disable_compile(False)
        try:
            dispatcher.compile(signature)
        finally:
            dispatcher.disable_compile()
