"""TensorDicts in and out (TorchRL's layout), with ``tensordict`` an optional extra: nothing
here imports it until a TensorDict is handed in or asked for. The rules key by key:
docs/porting.md, "From the other libraries"."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from shardreplay.buffer.nstep import _check_gamma
from shardreplay.errors import ConfigError, SpecMismatchError
from shardreplay.spec import Spec
from shardreplay.spec.fields import StepType

__all__ = ["is_tensordict", "tensordict_gamma", "tensordict_writes", "transition_names"]

FIRST, MID, LAST = int(StepType.FIRST), int(StepType.MID), int(StepType.LAST)

# One write for the buffer: (step dict [S', ...] or [S', T'], stream ids or None, priorities or None).
Write = tuple[dict[str, np.ndarray], np.ndarray | None, np.ndarray | None]


def is_tensordict(value: Any) -> bool:
    """Whether ``value`` is a TensorDict (without importing ``tensordict``: a TensorDict
    can exist only once its module is imported)."""
    module = sys.modules.get("tensordict")
    return module is not None and isinstance(value, module.TensorDictBase)


def tensordict_gamma(gamma: float | None, window: int) -> float:
    """The gamma of ``sample(..., as_tensordict=True)``: 1-step windows need none (their
    reward is one reward; 1.0 keeps the termination in ``bootstrap_discount``).

    Raises:
        ConfigError: no ``gamma`` for windows of more than 2 steps, or one outside [0, 1].
    """
    if gamma is not None:
        _check_gamma(gamma)
        return gamma
    if window > 2:
        raise ConfigError(f"sample(..., as_tensordict=True) of windows of {window} steps sums "
                          f"{window - 1}-step returns: pass gamma= (the loss's gamma)")
    return 1.0


def transition_names(spec: Spec) -> dict[str, str]:
    """The spec's observation, action and reward field names, as ``sample_transitions``
    takes them: the observation is ``"obs"`` (or ``"obs.*"``), else ``"observation"``."""
    return {"observation": _observation_name(spec), "action": "action", "reward": "reward"}


def _observation_name(spec: Spec) -> str:
    for name in ("observation", "obs"):
        if any(f == name or f.startswith(name + ".") for f in spec.names):
            return name
    return "obs"


# -- in ---------------------------------------------------------------------------------------

def tensordict_writes(td: Any, spec: Spec, lead_ndim: int, priorities: Any,
                      fresh: Callable[[], np.ndarray]) -> list[Write]:
    """The writes that store ``td``, a TensorDict with ``lead_ndim`` batch dims (1: ``add``,
    2: ``extend``; the two layouts: docs/porting.md), with the caller's ``priorities``
    of the rows (or None); ``fresh()`` says per stream whether its next step starts an episode.

    Raises:
        SpecMismatchError: the batch dims, a missing field or ``("next", ...)`` entry,
            or next observations that do not continue the stream.
    """
    if len(td.batch_size) != lead_ndim:
        what = "[S] (one row per stream) for add" if lead_ndim == 1 else "[S, T] for extend"
        raise SpecMismatchError(f"a TensorDict's batch_size must be {what}, got {list(td.batch_size)}")
    leaves = _leaves(td)
    if ("step_type",) in leaves:
        return [({".".join(k): v for k, v in leaves.items()}, None, priorities)]
    starts = fresh()
    if td.batch_size[0] != starts.shape[0]:
        call = "add" if lead_ndim == 1 else "extend"
        raise SpecMismatchError(
            f"{call}(td) takes one row per stream written ({starts.shape[0]}), got batch_size "
            f"{list(td.batch_size)}; a collector's [T] rollout of one env is extend(td.unsqueeze(0))")
    rows, nexts, term, trunc = _transition_rows(leaves, spec, td.batch_size)
    if lead_ndim == 1:  # one row per stream: as [S, 1]
        rows = {k: v[:, None] for k, v in rows.items()}
        nexts = {k: v[:, None] for k, v in nexts.items()}
        term, trunc = term[:, None], trunc[:, None]
        priorities = None if priorities is None else np.asarray(priorities)[:, None]
    return _steps_of_rows(spec, rows, nexts, term, trunc, priorities, starts, lead_ndim == 1)


def _leaves(td: Any) -> dict[tuple[str, ...], np.ndarray]:
    """Every leaf of ``td`` by key tuple, as a CPU numpy array."""
    out = {}
    for key, value in td.items(include_nested=True, leaves_only=True):
        if not isinstance(value, torch.Tensor):
            continue  # non-tensor data (TorchRL's NonTensorData): no field can hold it
        out[key if isinstance(key, tuple) else (key,)] = value.detach().cpu().numpy()
    return out


def _transition_rows(leaves: dict[tuple[str, ...], np.ndarray], spec: Spec, lead: Any
                     ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Each spec field's rows, its ``("next", ...)`` values, and the two end flags."""
    obs = _observation_name(spec)
    lead = tuple(lead)

    def key_of(name: str) -> tuple[str, ...]:
        parts = tuple(name.split("."))
        if parts[0] == obs:
            return ("observation", *parts[1:])
        return ("next", "reward") if name == "reward" else parts

    rows: dict[str, np.ndarray] = {}
    nexts: dict[str, np.ndarray] = {}
    for name, field in spec.fields.items():
        key = key_of(name)
        if key not in leaves:
            raise SpecMismatchError(f"the TensorDict has no {_show(key)} for field {name!r}; it has "
                                    f"{sorted(_show(k) for k in leaves)} (the rule: "
                                    "docs/porting.md)")
        rows[name] = _fit(leaves[key], lead, field.shape, _show(key))
        if key[0] != "next" and ("next", *key) in leaves:
            nexts[name] = _fit(leaves[("next", *key)], lead, field.shape, _show(("next", *key)))
    flags = {k: _fit(leaves[("next", k)], lead, (), f"('next', {k!r})").astype(bool)
             for k in ("done", "terminated", "truncated") if ("next", k) in leaves}
    if "terminated" not in flags and "done" not in flags:
        raise SpecMismatchError("the TensorDict has neither ('next', 'terminated') nor ('next', 'done'); "
                                "TorchRL transitions need one (steps: give 'step_type' instead)")
    term = flags.get("terminated", flags.get("done"))
    assert term is not None
    trunc = flags.get("truncated", np.zeros(lead, bool))
    if "terminated" in flags and "done" in flags:  # a done that is neither: a truncation
        trunc = trunc | (flags["done"] & ~term)
    return rows, nexts, term, trunc & ~term


def _show(key: tuple[str, ...]) -> str:
    return repr(key[0]) if len(key) == 1 else repr(key)


def _fit(value: np.ndarray, lead: tuple[int, ...], shape: tuple[int, ...], what: str) -> np.ndarray:
    """``value`` as ``lead + shape``: a trailing unit axis dropped for a scalar."""
    if value.shape == (*lead, *shape):
        return value
    if shape == () and value.shape == (*lead, 1):
        return value.reshape(lead)
    raise SpecMismatchError(f"TensorDict entry {what} must be shaped {[*lead, *shape]}, got "
                            f"{list(value.shape)}")


def _steps_of_rows(spec: Spec, rows: dict[str, np.ndarray], nexts: dict[str, np.ndarray],
                   term: np.ndarray, trunc: np.ndarray, priorities: Any, fresh: np.ndarray,
                   one_step: bool) -> list[Write]:
    """Rows ``[S, T]`` as steps, a LAST step after each row whose episode ended."""
    done = term | trunc
    s, t = done.shape
    for name, nxt in nexts.items():  # o_t+1 must be the next row's o where the episode goes on
        goes_on = ~done[:, :-1]
        if t > 1 and not np.array_equal(nxt[:, :-1][goes_on], rows[name][:, 1:][goes_on]):
            raise SpecMismatchError(
                f"('next', ...) of field {name!r} differs from the next row's value where no episode "
                "ended: the rows of each stream must be consecutive steps ([S, T], time last)")
    types = np.full((s, t), MID, np.uint8)
    types[:, 1:][done[:, :-1]] = FIRST
    types[:, 0][fresh] = FIRST
    steps = {**rows, "step_type": types, "discount": np.ones((s, t), np.float32)}
    prios = None if priorities is None else np.broadcast_to(np.asarray(priorities), (s, t))
    if not done.any():
        return [(_squeeze(steps) if one_step else steps, None,
                 None if prios is None else (prios[:, 0] if one_step else prios))]
    last = _last_steps(spec, rows, nexts, term)
    if one_step:  # every row, then the LAST steps of the streams that ended
        ids = np.flatnonzero(done[:, 0]).astype(np.int64)
        return [(_squeeze(steps), None, None if prios is None else prios[:, 0]),
                ({k: v[ids, 0] for k, v in last.items()}, ids, None if prios is None else prios[ids, 0])]
    writes: list[Write] = []
    going = np.flatnonzero(~done.any(axis=1)).astype(np.int64)
    if going.size:
        writes.append(({k: v[going] for k, v in steps.items()}, going,
                       None if prios is None else prios[going]))
    for row in np.flatnonzero(done.any(axis=1)):
        at = np.flatnonzero(done[row]) + 1  # insert each LAST after its row
        chunk = {k: np.insert(v[row], at, last[k][row][at - 1], axis=0)[None] for k, v in steps.items()}
        writes.append((chunk, np.array([row], np.int64),
                       None if prios is None else np.insert(prios[row], at, prios[row][at - 1])[None]))
    return writes


def _last_steps(spec: Spec, rows: dict[str, np.ndarray], nexts: dict[str, np.ndarray],
                term: np.ndarray) -> dict[str, np.ndarray]:
    """The LAST step that would follow each row: ``("next", K)`` values, zero action and
    reward (padding), the row's other fields, discount 0 after a termination."""
    last = {}
    for name, value in rows.items():
        if name in nexts:
            last[name] = nexts[name]
        elif name in ("action", "reward"):
            last[name] = np.zeros_like(value)
        else:
            last[name] = value
    obs = _observation_name(spec)
    missing = [n for n in rows if (n == obs or n.startswith(obs + ".")) and n not in nexts]
    if missing:
        raise SpecMismatchError(f"an episode ended but the TensorDict has no ('next', 'observation') "
                                f"entry for {missing}: the LAST step needs the final observation")
    last["step_type"] = np.full(term.shape, LAST, np.uint8)
    last["discount"] = np.where(term, 0.0, 1.0).astype(np.float32)
    return last


def _squeeze(steps: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v[:, 0] for k, v in steps.items()}
