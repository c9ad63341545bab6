"""The buffer's state dict: layout, export and checked import (what it holds:
docs/semantics.md, "Saving a buffer, and where batches land")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from shardreplay.buffer.restore import RestoreSession, ShardParts
from shardreplay.errors import ConfigError, SpecMismatchError
from shardreplay.spec import Spec
from shardreplay.spec.keys import is_key_tag
from shardreplay.spec.validation import check_step_values

STATE_VERSION = 1


def export_state(shard: ShardParts, field_views: bool = False, start: np.ndarray | None = None
                 ) -> dict[str, Any]:
    """``{"meta": ..., "arrays": ...}`` of a buffer's shard (see ``ReplayBuffer.state_dict``).

    With ``field_views`` each user field is a list of views into storage (no copy); with
    ``start``, each row's steps from ``start[r]`` on (``StreamStorage.export_steps``).
    """
    storage, sampler, rng = shard._storage, shard._sampler, shard.rng
    arrays: dict[str, Any] = storage.export_steps(not field_views, start)
    sampler_meta = {}
    for key, value in sampler.state_dict().items():
        if isinstance(value, np.ndarray):
            arrays[f"sampler.{key}"] = value
        else:
            sampler_meta[key] = value
    meta = {
        "version": STATE_VERSION,
        "spec": shard.spec.to_dict(),
        "num_streams": storage.num_streams,
        "stream_capacity": storage.stream_capacity,
        "window": shard.window,
        "sampler": sampler.name,
        "sampler_state": sampler_meta,
        "next_episode_id": int(storage.counters[0]),
        "stale_updates": shard.stale_updates,
        "key_epoch": int(storage.key_epoch),
        "key_tag": int(storage.key_tag),
        "rng": rng.bit_generator.state,
    }
    if storage.period > 1:  # only then: a state without sequence windows is as it was
        meta["period"] = storage.period
    return {"meta": meta, "arrays": arrays}


def state_as_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every array of ``arrays`` as a CPU tensor sharing its memory."""
    return {"meta": state["meta"], "arrays": {k: torch.from_numpy(np.ascontiguousarray(v))
                                              for k, v in state["arrays"].items()}}


def import_state(shard: ShardParts, state: Mapping[str, Any]) -> None:
    """Check ``state`` fully, then restore it into a buffer's ``shard`` (all or nothing)."""
    storage, sampler = shard._storage, shard._sampler
    meta, arrays = _split(state)
    _check_layout(shard, meta)
    _check_arrays(shard, arrays)
    next_episode_id, stale_updates, key_epoch = _check_counters(meta, shard.rng)
    key_tag = meta.get("key_tag", storage.key_tag)  # a state from before key tags keeps ours
    if not is_key_tag(key_tag):
        raise ConfigError(f"state meta: key_tag {key_tag!r} is not a key tag; "
                          "pass a state from ReplayBuffer.state_dict()")
    episode_ids = arrays["episode_id"]
    if episode_ids.size and not 0 <= int(episode_ids.min()) <= int(episode_ids.max()) < next_episode_id:
        raise ConfigError("state: stored episode ids must lie in [0, next_episode_id); "
                          "pass a state from ReplayBuffer.state_dict()")
    sampler_state = _sampler_state(meta, arrays)
    sampler.check_state(sampler_state, arrays)
    # Everything is checked: from here on nothing can fail half-way.
    with RestoreSession(shard, "a state of load_state_dict()", 0) as session:
        _place(session, storage.stored_slots(arrays["row_pos"]), arrays)
        session.finish(arrays["row_pos"], next_episode_id, sampler_state=sampler_state, rng_state=meta["rng"],
                       stale_updates=stale_updates, key_epoch=key_epoch, key_tag=int(key_tag))


def _place(session: RestoreSession, stored: tuple[np.ndarray, np.ndarray], arrays: Mapping[str, Any]) -> None:
    """Place a checked state's steps through ``session`` at the ``stored`` slots and row
    lengths of its positions (the order of its arrays)."""
    slots, lengths = stored
    for name, target in session.targets().items():
        target[slots] = arrays[name]
    row_start = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    for name, store in session.frame_stores().items():  # row by row, in time order
        for r in range(lengths.shape[0]):
            a, b = row_start[r], row_start[r + 1]
            store.load_row(r, slots[a:b], arrays[f"field.{name}"][a:b], -1)
    starts = slots if session.period == 1 else slots[arrays["episode_step"] % session.period == 0]
    for name in session.start_fields():
        session.place_starts(name, starts, arrays[f"field.{name}"])


def _split(state: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, np.ndarray]]:
    if not isinstance(state, Mapping) or "meta" not in state or "arrays" not in state:
        raise ConfigError("a buffer state is a dict with 'meta' and 'arrays' (from state_dict())")
    meta, arrays = state["meta"], state["arrays"]
    if not isinstance(meta, Mapping) or not isinstance(arrays, Mapping):
        raise ConfigError("a buffer state's 'meta' and 'arrays' must be dicts (from state_dict())")
    if meta.get("version") != STATE_VERSION:
        raise ConfigError(f"buffer state version {meta.get('version')} is not supported "
                          f"(this shardreplay reads version {STATE_VERSION})")
    # A CPU tensor's memory is shared, not copied; anything else is checked later.
    return meta, {k: v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v
                  for k, v in arrays.items()}


def _check_layout(shard: ShardParts, meta: Mapping[str, Any]) -> None:
    if Spec.from_dict(meta["spec"]) != shard.spec:
        raise SpecMismatchError(f"the state's spec {Spec.from_dict(meta['spec'])} differs from the "
                                f"buffer's {shard.spec}")
    for name in ("num_streams", "stream_capacity", "window"):
        have = getattr(shard._storage, name)
        if int(meta[name]) != have:
            raise ConfigError(f"the state has {name}={meta[name]}, the buffer {have}; "
                              "restore onto another layout with shardreplay.checkpoint.load")
    if int(meta.get("period", 1)) != shard._storage.period:
        raise ConfigError(f"the state has period={meta.get('period', 1)}, the buffer "
                          f"{shard._storage.period}; make the buffer with the state's period")
    if meta["sampler"] != shard._sampler.name:
        raise ConfigError(f"the state is of a {meta['sampler']} sampler, the buffer "
                          f"{shard._sampler.name}")


def _check_counters(meta: Mapping[str, Any], rng: np.random.Generator) -> tuple[int, int, int]:
    """Parse the counters and try the RNG state on a scratch generator, before any change."""
    try:
        next_episode_id = _count(meta["next_episode_id"])
        stale_updates = _count(meta.get("stale_updates", 0))
        key_epoch = _count(meta.get("key_epoch", 0))
        type(rng.bit_generator)().state = meta["rng"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"state meta: missing or malformed counters or RNG state ({exc!r}); "
                          "pass a state from ReplayBuffer.state_dict()") from exc
    if next_episode_id < 0 or stale_updates < 0 or key_epoch < 0:
        raise ConfigError("state meta: next_episode_id, stale_updates and key_epoch must be >= 0")
    return next_episode_id, stale_updates, key_epoch


def _count(value: Any) -> int:
    """An integer counter (a float or bool is a damaged state, not a count)."""
    if not isinstance(value, int | np.integer) or isinstance(value, bool):
        raise TypeError(f"expected an integer, got {value!r}")
    return int(value)


def _sampler_state(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The sampler's entries: scalars from ``meta``, arrays named ``sampler.*``."""
    scalars = meta.get("sampler_state", {})
    if not isinstance(scalars, Mapping):
        raise ConfigError(f"state meta: 'sampler_state' must be a dict, got {type(scalars).__name__}; "
                          "pass a state from ReplayBuffer.state_dict()")
    out = dict(scalars)
    out.update({k[len("sampler."):]: v for k, v in arrays.items() if k.startswith("sampler.")})
    return out


def _check_arrays(shard: ShardParts, arrays: Mapping[str, np.ndarray]) -> None:
    pos = np.asarray(arrays.get("row_pos", ()))
    if pos.shape != (shard._storage.num_streams,) or pos.dtype.kind not in "iu" or (pos < 0).any():
        raise ConfigError("state arrays: row_pos must be one non-negative integer position per stream")
    lengths = np.minimum(pos, shard._storage.stream_capacity)
    if not np.array_equal(np.asarray(arrays.get("row_length", ())), lengths):
        raise ConfigError("state arrays: row_length does not match row_pos and stream_capacity")
    n = int(lengths.sum())
    period, offsets = shard._storage.period, np.asarray(arrays.get("episode_step", ()))
    starts = n if period == 1 or offsets.shape != (n,) else int((offsets % period == 0).sum())
    for name, (dtype, shape) in expected_arrays(shard.spec, shard._storage.step_arrays, n, starts).items():
        arr = arrays.get(name)
        if arr is None or arr.shape != shape or arr.dtype != dtype:
            got = None if arr is None else f"{arr.dtype}{list(arr.shape)}"
            raise ConfigError(f"state array {name!r}: expected {dtype}{list(shape)}, got {got}")
    _check_step_values(arrays)


Shape = tuple[np.dtype, tuple[int, ...]]


def expected_arrays(spec: Spec, step_arrays: Mapping[str, Any], steps: int, starts: int) -> dict[str, Shape]:
    """The dtype and shape of every array of ``steps`` stored steps (a state's, a part's),
    ``starts`` of them window starts: ``at_starts`` fields hold a row per start only."""
    out: dict[str, Shape] = {k: (np.dtype(dt), (steps,)) for k, dt in step_arrays.items()}
    out.update({f"field.{k}": (np.dtype(f.dtype), (starts if f.at_starts else steps, *f.shape))
                for k, f in spec.fields.items()})
    return out


def _check_step_values(arrays: Mapping[str, np.ndarray]) -> None:
    """Values the write path guarantees: step types in {0, 1, 2}, discounts in [0, 1],
    priorities finite and >= 0 (a NaN would poison the sum tree)."""
    check_step_values(arrays["step_type"], arrays["discount"], exc=ConfigError, where="state arrays: ")
    priority = arrays["priority"]
    if not ((priority >= 0) & (priority < np.inf)).all():
        raise ConfigError("state array 'priority': values must be finite and >= 0")
