"""A restore session: the one way a loader replaces a shard's content (internal; the
protocol: docs/internals.md, "Restore sessions")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from shardreplay.errors import CheckpointError, ShardReplayError
from shardreplay.samplers import Sampler
from shardreplay.spec import Spec
from shardreplay.storage import StreamStorage

_OPEN, _FINISHED, _CLOSED = "open", "finished", "closed"


class ShardParts(Protocol):
    """What a session and the state dict (state.py) read and restore of a
    :class:`~shardreplay.buffer.shard.Shard`, typed by these members so that the Shard's
    module (which uses both) is not imported back."""

    spec: Spec
    window: int
    _storage: StreamStorage
    _sampler: Sampler
    rng: np.random.Generator
    stale_updates: int
    _restoring: RestoreSession | None


class RestoreSession:
    """An in-progress restore of ``shard`` from ``source`` (a checkpoint path, which
    ``save``'s refusal names), made by :meth:`Shard.restore` (docs/internals.md, "Restore
    sessions"). While empty the shard keeps a key epoch of at least ``key_epoch_floor``, so
    keys handed out from the replaced content stay stale.

    Raises:
        CheckpointError: any method called out of order: outside the with-block, after
            ``finish``, or ``finish`` twice.
    """

    def __init__(self, shard: ShardParts, source: str, key_epoch_floor: int) -> None:
        self._shard = shard
        self._floor = int(key_epoch_floor)
        self._state = _CLOSED
        self.source = source
        self._starts: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # see place_starts

    def __enter__(self) -> RestoreSession:
        if self._state != _CLOSED or self._shard._restoring is self:
            raise CheckpointError("a restore session is entered once; start another with shard.restore()")
        self._shard._restoring = self  # the shard owns its guard: save asks it
        self._state = _OPEN
        self.reset()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        finished = self._state == _FINISHED
        if exc_type is None and finished:
            self._state = _CLOSED
            self._shard._restoring = None  # final: it may be saved again
            return
        self._state = _OPEN
        self.reset()
        self._state = _CLOSED  # the shard stays pending: save refuses it
        if exc_type is None:
            raise CheckpointError(f"the restore of {self.source} ended before finish(): the shard is left "
                                  "empty and will not be saved; restore it again")

    @property
    def stream_capacity(self) -> int:
        """Steps per row of the shard."""
        return self._shard._storage.stream_capacity

    def _check(self, allowed: str, what: str) -> None:
        if self._state != allowed:
            raise CheckpointError(f"restore session of {self.source}: {what} is not allowed now "
                                  f"(session is {self._state}); place steps, then finish() once, "
                                  "inside the with-block")

    def targets(self) -> dict[str, np.ndarray]:
        """Where steps are placed: every per-slot array by flat slot, named as in a state
        (``field.<name>`` for plain fields, and the per-step arrays). Frame-stacked fields
        go through :meth:`frame_stores` instead."""
        self._check(_OPEN, "placing steps")
        storage = self._shard._storage
        out = {f"field.{k}": v for k, v in storage.fields.items()}
        out.update({k: getattr(storage, k) for k in storage.step_arrays})
        return out

    def frame_stores(self) -> Mapping[str, Any]:
        """The frame rings of frame-stacked fields (``FrameStore`` by field name)."""
        self._check(_OPEN, "placing frames")
        return self._shard._storage.stacked

    @property
    def period(self) -> int:
        """The shard's sequence period (1: every step starts a window)."""
        return self._shard._storage.period

    def start_fields(self) -> Mapping[str, Any]:
        """The ``at_starts`` fields of the shard's spec (``Field`` by name): placed
        through :meth:`place_starts`."""
        self._check(_OPEN, "placing start rows")
        return dict(self._shard._storage.starts)

    def place_starts(self, name: str, slots: np.ndarray, values: np.ndarray) -> None:
        """The rows ``values`` of ``at_starts`` field ``name`` for the steps placed at flat
        ``slots`` (at least every step that starts a window under this shard's period);
        kept when :meth:`finish` sets the positions."""
        self._check(_OPEN, "placing start rows")
        self._starts[name] = (np.asarray(slots, np.int64), values)

    def finish(self, pos: np.ndarray, next_episode_id: int, *, sampler_state: Mapping[str, Any],
               rng_state: Mapping[str, Any] | None, stale_updates: int, key_epoch: int,
               key_tag: int | None) -> None:
        """After steps were placed: set positions, rebuild validity and the sampler's trees,
        load ``sampler_state`` (its ``load_state_dict``: a prioritized sampler's maximum
        priority and schedule position, a fifo's waiting windows; what a sampler does not
        keep is ignored), the RNG (when given), the stale-update count, the key epoch and
        (when given) the key tag."""
        self._check(_OPEN, "finish()")
        shard = self._shard
        try:
            shard._storage.finish_restore(pos, next_episode_id, self._starts)
        except ShardReplayError as exc:  # a start step without its row
            raise CheckpointError(f"cannot restore {self.source}: {exc}") from exc
        shard._sampler.rebuild()
        shard._sampler.load_state_dict(dict(sampler_state))
        if rng_state is not None:
            shard.rng.bit_generator.state = dict(rng_state)
        shard.stale_updates = int(stale_updates)
        shard._storage.key_epoch = int(key_epoch)
        if key_tag is not None:
            shard._storage.key_tag = int(key_tag)
        self._state = _FINISHED

    def reset(self) -> None:
        """Empty the shard again (sampler state reset, the key epoch at least the floor)
        for another try; the session is open again."""
        if self._state == _CLOSED:
            raise CheckpointError(f"restore session of {self.source}: reset() outside its with-block")
        shard = self._shard
        self._starts = {}
        shard._storage.clear()
        shard._storage.finish_restore(shard._storage.pos, 0)
        shard._sampler.rebuild()
        shard._sampler.load_state_dict({"max_priority": 1.0, "draws": 0})
        shard._storage.key_epoch = max(shard._storage.key_epoch, self._floor)
        self._state = _OPEN
