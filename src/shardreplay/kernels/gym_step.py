"""The compiled write of a gymnasium vector env's step (gym/writer.py holds the
writer): every env's held step into the storage and its bookkeeping, in one call."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from shardreplay.kernels.storage import write_steps

FIRST, MID, LAST = 0, 1, 2
HELD = 8  # where the held step types start in the compiled write's state array
_NO_PRIORITIES = np.zeros((1, 1), np.float32)


@numba.njit(cache=True, nogil=True)
def _all_finite(values):  # pragma: no cover - compiled
    """No NaN or inf among ``values``."""
    for v in values.ravel():  # noqa: SIM110 - a loop numba compiles (no generators)
        if not np.isfinite(v):
            return False
    return True


def gym_write(records, pos, counters, state, fstate, obs_store, act_store, rew_store, held_obs,
              action, obs, reward, terminated, truncated):  # pragma: no cover - compiled
    """Write every env's held step, then hold the new observation, step type and discount.

    ``records`` is the storage's per-slot record array (bookkeeping and discount);
    ``state`` (int64) is ``[stream_capacity, window, same_step, finite obs, finite action,
    finite reward, steps written, episodes ended]``, then per env its held step type, then
    ``0 .. num_envs - 1``, then ``out`` ``[4, num_envs * window]``: the written slots (row
    0), the recomputed slots (row 1), their validity (row 2) and whether each became valid
    (row 3). ``fstate`` is ``[priority of new steps, held discount of each env ...]``.
    Arguments are few and nothing is allocated on purpose: each argument costs the
    dispatcher time on every step.

    Returns ``(n_out, delta)``, or ``(code, 0)`` with nothing changed: -1 .. -3 when the
    obs, action or reward of a finite field holds NaN or inf, -4 when an input has the
    wrong shape."""
    num_envs = held_obs.shape[0]
    if (obs.shape != held_obs.shape or action.shape[0] != num_envs or action.shape[1:] != act_store.shape[1:]
            or reward.shape[0] != num_envs or terminated.shape[0] != num_envs
            or truncated.shape[0] != num_envs):
        return -4, 0
    if state[3] and not _all_finite(obs):
        return -1, 0
    if state[4] and not _all_finite(action):
        return -2, 0
    if state[5] and not _all_finite(reward):
        return -3, 0
    types = state[HELD:HELD + num_envs].reshape(num_envs, 1)
    rows = state[HELD + num_envs:HELD + 2 * num_envs]
    out = state[HELD + 2 * num_envs:].reshape(4, num_envs * state[1])
    n_out, delta = write_steps(records.step_type, records.episode_id, records.generation, records.priority,
                               records.valid, pos, counters, rows, types, _NO_PRIORITIES, False, fstate[0],
                               state[0], state[1], out[:2], out[2:])
    disc_store = records.discount
    same_step = state[2] != 0
    n_done = 0
    for i in range(num_envs):
        slot = out[0, i]
        was_last = types[i, 0] == LAST
        obs_store[slot] = held_obs[i]
        if was_last:  # the env ignored this action (NEXT_STEP reset): padding
            act_store[slot] = 0
            rew_store[slot] = 0
        else:
            act_store[slot] = action[i]
            rew_store[slot] = reward[i]
        disc_store[slot] = fstate[1 + i]
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
        held_obs[i] = obs[i]
    state[6] += num_envs
    state[7] += n_done
    return n_out, delta


def compiled_gym_write(head: tuple[np.ndarray, ...], inputs: tuple[np.ndarray, ...]) -> Any:
    """A dispatcher of :func:`gym_write` compiled for ``head + inputs`` only, which compiles
    nothing by itself: a call with argument types it was not compiled for raises
    ``TypeError``. The writer adds (compiles, or loads from numba's cache) one signature
    per kind of inputs it accepted, so the types numba reads at dispatch are the whole
    per-call input check."""
    dispatcher = numba.njit(cache=True, nogil=True)(gym_write)
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
