"""Shard: one buffer's storage, sampler, RNG and key codec behind one internal seam, under
``ReplayBuffer``'s thin public face; the sharded buffer and checkpoints reach it through
:func:`shard_of_buffer` only. Internal: no name here is exported from ``shardreplay``."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from shardreplay.buffer.batch import BufferInfo
from shardreplay.buffer.checks import check_priorities, check_stream_ids, foreign_key
from shardreplay.buffer.restore import RestoreSession
from shardreplay.buffer.state import export_state
from shardreplay.errors import ConfigError, EmptyBufferError, InvalidKeyError, SpecMismatchError
from shardreplay.kernels.codes import PRIORITY_BLOCK
from shardreplay.kernels.lazy import lazy
from shardreplay.samplers import Draw, FifoSampler, PrioritizedSampler, Sampler, UniformSampler
from shardreplay.samplers.schedules import Schedule
from shardreplay.spec import Spec
from shardreplay.storage import SEQUENCE_STEP_ARRAYS, STEP_ARRAYS, ArrayAllocator, StreamStorage
from shardreplay.storage.allocate import advise_hugepages
from shardreplay.storage.one_step import OneStepAdd, one_step_add
from shardreplay.storage.streams import ring_runs

if TYPE_CHECKING:
    from shardreplay.kernels import keys as key_kernels
    from shardreplay.kernels import storage as storage_kernels
else:  # numba loads on the first compiled call, not on import (kernels/lazy.py)
    storage_kernels = lazy("shardreplay.kernels.storage")
    key_kernels = lazy("shardreplay.kernels.keys")

# One-step adds on the full path before the short one is built (see Shard.__init__).
ONE_STEP_AFTER = 1000

__all__ = ["SEQUENCE_STEP_ARRAYS", "STEP_ARRAYS", "Draw", "Shard", "ShardStats", "advise_hugepages",
           "ring_runs", "shard_of_buffer"]


@dataclass(frozen=True)
class ShardStats:
    """What a shard tells the other ranks before a sharded draw.

    ``mass``: valid count (uniform, fifo) or ``sum p^alpha`` (prioritized); ``samplable``:
    windows that can be drawn; ``min_leaf``: smallest positive per-start mass (inf when
    nothing is samplable); ``beta``: importance-weight exponent now; ``max_priority``: the
    priority of a start written without one; ``key_tag``: the tag of this shard's keys.
    """

    mass: float
    samplable: int
    min_leaf: float
    beta: float
    max_priority: float
    key_tag: int


class Shard:
    """Steps of ``num_streams`` rings, with their sampler, sampling RNG and key codec.

    Args: as :class:`~shardreplay.ReplayBuffer` (checked there).
    """

    def __init__(self, spec: Spec, num_streams: int, stream_capacity: int, window: int, sampler: str,
                 alpha: float, beta: Schedule, seed: int | None, storage: str,
                 directory: str | Path | None, period: int = 1) -> None:
        self.spec = spec
        self.window = window
        self._storage = StreamStorage(spec, num_streams, stream_capacity, window,
                                     ArrayAllocator(storage, directory), period)
        self._sampler: Sampler = _make_sampler(sampler, self._storage, alpha, beta)
        self.rng = np.random.default_rng(seed)
        self.stale_updates = 0  # updates whose window was overwritten since it was sampled
        self.updates_applied = 0  # updates applied to this shard, from any caller
        self.invalid_keys = 0  # routed updates whose key fits no slot here (skipped)
        # The short path of one-step adds (storage/one_step.py), built after
        # ONE_STEP_AFTER adds took the full path: a buffer that only ever takes a few
        # one-step adds (or chunks) never pays for compiling (or loading) its kernel.
        self._one_step: OneStepAdd | None = None
        self._first: tuple[str, ...] = ()  # fields first in its order (held_writer's)
        self._full_adds = 0
        self._restoring: RestoreSession | None = None  # a restore not finished (save refuses)
        # What shardreplay.checkpoint keeps with this shard's content (the restore it came
        # from, the incremental chain of its saved parts), each entry stamped with the
        # ``clears`` it holds for: replaced content ends them.
        self.checkpoint_notes: dict[str, Any] = {}
        # Per block of slots, updates_applied after its last update (incremental checkpoints).
        self.priority_marks = np.zeros(-(-self._storage.size // PRIORITY_BLOCK), np.int64)
        # Held while a background checkpoint's writer (a forked child) writes this shard's
        # part: the next save, a restore or load_state_dict waits for it.
        self._saving = threading.Lock()

    # -- sizes ------------------------------------------------------------------------------
    @property
    def num_streams(self) -> int:
        """Rows (streams)."""
        return self._storage.num_streams

    @property
    def stream_capacity(self) -> int:
        """Steps per row."""
        return self._storage.stream_capacity

    @property
    def period(self) -> int:
        """Steps between window starts in an episode (1: every step; docs/semantics.md)."""
        return self._storage.period

    @property
    def capacity(self) -> int:
        """Slots in all: ``num_streams * stream_capacity``."""
        return self._storage.size

    @property
    def num_steps(self) -> int:
        """Steps stored now."""
        return self._storage.num_steps

    def samplable(self) -> int:
        """Windows that can be drawn now (fifo: not yet drained; others: valid starts)."""
        if isinstance(self._sampler, FifoSampler):
            return self._sampler.num_samplable()
        return self._storage.num_valid

    @property
    def key_tag(self) -> int:
        """The tag every key of this shard carries (see ``spec/keys.py``)."""
        return self._storage.key_tag

    @property
    def key_epoch(self) -> int:
        """Added to every slot's write count in a key: raised by restores."""
        return self._storage.key_epoch

    @property
    def sampler_name(self) -> str:
        """``"uniform"``, ``"prioritized"`` or ``"fifo"``."""
        return self._sampler.name

    def prioritized_settings(self) -> tuple[float, Schedule] | None:
        """``(alpha, beta schedule)`` of a prioritized sampler, None for the others."""
        s = self._sampler
        return (s.alpha, s.beta) if isinstance(s, PrioritizedSampler) else None

    def sampler_state(self) -> dict[str, Any]:
        """The sampler's counters (``state_dict``: prioritized ``max_priority``, ``draws``)."""
        return self._sampler.state_dict()

    @property
    def sum_tree(self) -> Any:
        """The prioritized sampler's sum tree, None for the others."""
        return getattr(self._sampler, "tree", None)

    @property
    def clears(self) -> int:
        """Times the storage was emptied (restores): a checkpoint chain of older content ends."""
        return self._storage.clears

    @property
    def start_names(self) -> tuple[str, ...]:
        """The ``at_starts`` fields (kept at window starts only)."""
        return tuple(self._storage.starts)

    @property
    def stacked_names(self) -> tuple[str, ...]:
        """The frame-stacked fields."""
        return tuple(self._storage.stacked)

    def stored_start_flags(self) -> np.ndarray:
        """Per stored slot (in ``stored_slots`` order): whether it can start a window."""
        storage = self._storage
        return storage.is_start(storage.stored_slots()[0])

    def arrays(self) -> dict[str, np.ndarray]:
        """Views of the stored arrays by flat slot: ``field.<name>`` of every field not
        frame-stacked, the per-step arrays and ``valid``."""
        storage = self._storage
        out = {f"field.{k}": v for k, v in storage.fields.items()}
        out.update({k: getattr(storage, k) for k in (*STEP_ARRAYS, "valid")})
        return out

    def export_steps(self) -> dict[str, np.ndarray]:
        """Every stored step, row after row in time order (``StreamStorage.export_steps``)."""
        return self._storage.export_steps()

    def info(self) -> BufferInfo:
        """Sizes and counters as one record."""
        return BufferInfo(sampler=self._sampler.name, num_steps=self.num_steps, samplable=self.samplable(),
                          capacity=self.capacity, stale_updates=self.stale_updates,
                          updates_applied=self.updates_applied, invalid_keys=self.invalid_keys,
                          max_priority=self._sampler.default_priority(), key_tag=self.key_tag)

    # -- writing ----------------------------------------------------------------------------
    def write(self, step: Mapping[str, Any], stream_ids: Any, priorities: Any, t_len: int | None) -> None:
        """Check and write one step (``t_len`` None) or ``t_len`` steps per stream.

        Raises:
            SpecMismatchError, InvalidPriorityError: as ``ReplayBuffer.add``; nothing is written.
        """
        if stream_ids is None and priorities is None and type(step) is dict:
            fast = self._one_step
            if fast is not None:  # one step of every stream: the one-step writer, or the full path
                if fast.add(step if t_len is None else _one_step_of(step, t_len)):
                    return
            elif t_len in (None, 1) and self._full_adds <= ONE_STEP_AFTER:
                self._full_adds += 1
                if self._full_adds > ONE_STEP_AFTER:
                    self.use_one_step()
        self.write_full(step, stream_ids, priorities, t_len)

    def write_full(self, step: Mapping[str, Any], stream_ids: Any, priorities: Any,
                   t_len: int | None) -> None:
        """:meth:`write` without the short path of one-step adds: the full validation.

        Raises:
            SpecMismatchError, InvalidPriorityError: as ``ReplayBuffer.add``; nothing is written.
        """
        storage = self._storage
        if stream_ids is None:
            rows = storage.all_rows
        elif (type(stream_ids) is np.ndarray and stream_ids.dtype == np.int64 and stream_ids.ndim == 1
              and storage_kernels.rows_distinct_in_range(stream_ids, storage.num_streams, storage.row_marks)):
            rows = stream_ids  # the usual case, checked in one compiled pass
        else:
            rows = check_stream_ids(stream_ids, storage.num_streams)  # converts, or raises why
        if t_len is not None and t_len > storage.stream_capacity:
            raise SpecMismatchError(f"a chunk of {t_len} steps exceeds stream_capacity "
                                    f"{storage.stream_capacity}; split it")
        lead = (rows.shape[0],) if t_len is None else (rows.shape[0], t_len)
        steps = self.spec.validate(step, lead)
        prios = None if priorities is None else check_priorities(priorities, lead)
        sampler = self._sampler
        if prios is not None and isinstance(sampler, PrioritizedSampler):
            sampler.note_priorities(prios)
        slots, valid, newly = storage.write(steps, rows, 1 if t_len is None else t_len, prios,
                                            sampler.default_priority())
        sampler.on_write(slots, valid, newly)

    def use_one_step(self, enabled: bool = True) -> bool:
        """Build the short path of one-step adds now (compiled, or loaded from numba's
        cache, once), or with ``enabled=False`` never take it (every add then takes the
        full path: tests compare the two). Returns whether the short path is in use (False
        when this spec has none: see ``storage/one_step.py``)."""
        if not enabled or self._storage.period > 1:  # sequence offsets: full path (streams.py)
            if self._one_step is not None:
                self._one_step.open = False  # a writer's held_writer then takes Shard.write
            self._one_step = None
        elif self._one_step is None:
            # Uniform sampling records priority 1.0 and keeps no state per start.
            uniform = isinstance(self._sampler, UniformSampler)
            self._one_step = one_step_add(self._storage, None if uniform else self._sampler.default_priority,
                                          None if uniform else self._sampler.on_write, self._first)
        self._full_adds = ONE_STEP_AFTER + 2  # decided: built once, whatever the outcome
        return self._one_step is not None

    def held_writer(self, first: tuple[str, str, str]) -> Callable[..., int] | None:
        """``GymStepWriter``'s positional write through the one-step writer (see
        ``OneStepAdd.held_writer``; the fields ``first`` in that order), built now unless
        :meth:`use_one_step` decided already (a writer of one-step adds compiles when it is
        made, not in its first steps); None when this spec has no one-step writer or a
        frame-stacked field."""
        if not self._storage.stacked and self._first != first:
            self._first = first
            if self._one_step is not None:  # rebuilt in this order
                self.use_one_step(False)
                self.use_one_step()
        if self._full_adds <= ONE_STEP_AFTER:
            self.use_one_step()
        return None if self._one_step is None or self._storage.stacked else self._one_step.held_writer()

    # -- sampling ---------------------------------------------------------------------------
    def stats(self) -> ShardStats:
        """Mass, samplable count, smallest leaf, beta, max priority and key tag now."""
        s = self._sampler
        count = s.num_samplable()
        return ShardStats(s.mass(), count, s.min_leaf() if count else math.inf, s.current_beta(),
                          s.default_priority(), self._storage.key_tag)

    def draw(self, n: int, *, advance_schedule: bool = True) -> Draw:
        """Choose ``n`` window starts (fifo: at most ``n``, oldest first).

        ``advance_schedule=False`` leaves the beta schedule where it is (a sharded buffer
        advances it once per global sample with :meth:`advance_schedule`).

        Raises:
            ConfigError: ``n`` < 1.
            EmptyBufferError: no valid window can be drawn.
        """
        if not isinstance(n, int | np.integer) or n < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {n!r}")
        if self._sampler.num_samplable() == 0:
            raise EmptyBufferError(
                f"nothing to sample: {self.num_steps} steps stored, 0 valid windows of {self.window} "
                "steps (write more steps, or check that priorities are not all 0)")
        return self._sampler.draw(int(n), self.rng, advance_schedule)

    def advance_schedule(self) -> None:
        """Move the beta schedule one sample call forward without drawing."""
        if isinstance(self._sampler, PrioritizedSampler):
            self._sampler.draws += 1

    def current_beta(self) -> float:
        """The importance-weight exponent of the next draw (0 when unweighted)."""
        return self._sampler.current_beta()

    def gather(self, starts: np.ndarray,
               into: tuple[np.ndarray, Mapping[str, int], np.ndarray] | None = None) -> tuple[Any, ...]:
        """The windows at flat ``starts``.

        Without ``into``: ``(data [B, L, ...] per field, mask [B, L], keys [B])`` (numpy,
        keys of shard 0). With ``into=(out, offsets, rows)``: the windows are written into
        rows ``rows`` of the packed byte records ``out`` (field ``f`` at byte
        ``offsets[f]``), and ``(mask, keys)`` is returned.
        """
        if into is None:
            return self._storage.windows(starts)
        out, offsets, rows = into
        return self._storage.windows_into(starts, out, offsets, rows)

    # -- priorities -------------------------------------------------------------------------
    def apply_priorities(self, keys: np.ndarray, prios: np.ndarray) -> int:
        """Set priorities of the windows ``keys`` (int64 keys of shard 0, float32 priorities,
        shapes checked by the caller; the callers refuse an unweighted sampler); stale keys
        are counted and skipped. Returns the number applied.

        Raises:
            InvalidPriorityError: a priority is negative, NaN or inf.
            InvalidKeyError: a key is not a key of this shard.
            Nothing changes when an error is raised.
        """
        sampler = cast(PrioritizedSampler, self._sampler)  # the callers refuse the others
        status, bad, n = sampler.update_keys(keys, prios, self.priority_marks, self.updates_applied)
        if status == key_kernels.BAD_PRIORITY:
            check_priorities(prios, keys.shape)  # raises with the precise reason
        if status == key_kernels.BAD_KEY:
            raise InvalidKeyError(foreign_key(keys, bad, "buffer"))
        self.stale_updates += keys.shape[0] - n
        self.updates_applied += n
        return n

    def apply_routed(self, keys: np.ndarray, prios: np.ndarray) -> int:
        """:meth:`apply_priorities` of updates routed here by other ranks: keys that fit no
        slot of this shard (another tag or place) are counted in ``invalid_keys`` and skipped."""
        keys = np.ascontiguousarray(keys, np.int64)
        fits = key_kernels.keys_fit(keys, self._storage.key_tag, self.capacity)
        if not fits.all():
            self.invalid_keys += int((~fits).sum())
            keys, prios = keys[fits], prios[fits]
        return self.apply_priorities(keys, prios) if keys.size else 0

    @property
    def max_priority(self) -> float:
        """The priority a start written without one gets: the largest seen so far
        (prioritized), 1.0 for uniform and fifo sampling."""
        return self._sampler.default_priority()

    def raise_max_priority(self, value: float) -> None:
        """Raise the running maximum priority to ``value`` when larger (no effect without
        priorities): a sharded buffer agrees on the global maximum this way."""
        sampler = self._sampler
        if isinstance(sampler, PrioritizedSampler) and math.isfinite(value) and value > sampler.max_priority:
            sampler.max_priority = float(value)

    # -- checkpoints ------------------------------------------------------------------------
    def export(self, start: np.ndarray | None = None) -> dict[str, Any]:
        """This shard's state for a checkpoint: as ``ReplayBuffer.state_dict`` but numpy,
        each user field a list of views into storage by row in time order (no copy; valid
        until the next write); with ``start``, each row's steps ``[start[r], position[r])``
        (a frame-stacked field: its stacks, as pieces built when each is read)."""
        return export_state(self, True, start)

    @property
    def file_backed(self) -> bool:
        """Whether the storage is memory-mapped files (``storage="memmap"``): its pages are
        shared with a forked process, not copied on write."""
        return isinstance(self._storage.records, np.memmap)

    def regroup(self) -> None:
        """After a background save: its arrays on huge pages again (``StreamStorage.regroup``)."""
        self._storage.regroup()

    def begin_save(self) -> None:
        """A background checkpoint's writer starts (waits for the one before to end)."""
        self._saving.acquire()

    def end_save(self) -> None:
        """The background checkpoint's writer ended (any thread)."""
        self._saving.release()

    def wait_saved(self) -> None:
        """Wait until no background checkpoint's writer runs: the content must not be
        replaced, nor another part saved, before that one is written."""
        with self._saving:
            pass

    @property
    def fields(self) -> Mapping[str, np.ndarray]:
        """The stored user fields by flat slot (templates of their dtypes and shapes)."""
        return self._storage.fields

    def stacked_template(self, name: str) -> np.ndarray:
        """An empty array of frame-stacked field ``name``'s dtype and stack shape."""
        field = self._storage.stacked[name].field
        return np.empty((0, *field.shape), field.dtype)

    @property
    def positions(self) -> np.ndarray:
        """Steps ever written to each row (read only: a copy)."""
        return self._storage.pos.copy()

    # -- restoring --------------------------------------------------------------------------
    def restore(self, source: str, key_epoch_floor: int = 0) -> RestoreSession:
        """A :class:`RestoreSession`, the one way to replace this shard's content
        (:mod:`shardreplay.buffer.restore` says how), of ``source`` (named when a save is
        refused); the emptied shard keeps a key epoch of at least ``key_epoch_floor``.
        Waits first for a background checkpoint of this shard to finish writing."""
        self.wait_saved()
        return RestoreSession(self, source, key_epoch_floor)

    @property
    def pending_restore(self) -> str | None:
        """The source of a restore that has not finished (this shard's content must not
        be saved: it is empty or partly restored), or None."""
        return None if self._restoring is None else self._restoring.source


class HoldsShard(Protocol):
    """A buffer with a :class:`Shard` behind it (a ``ReplayBuffer``), typed by its
    attribute so that this module does not import the buffer built on it."""

    _shard: Shard


def shard_of_buffer(buffer: HoldsShard) -> Shard:
    """The :class:`Shard` behind ``buffer`` (a ``ReplayBuffer``): the one internal
    accessor the sharded buffer, checkpoints and ``shardreplay.testing`` use."""
    return buffer._shard


def _make_sampler(name: str, storage: StreamStorage, alpha: float, beta: Schedule) -> Sampler:
    if name == "prioritized":
        return PrioritizedSampler(storage, alpha, beta)
    if name == "fifo":
        return FifoSampler(storage)
    return UniformSampler(storage)


def _one_step_of(chunk: dict[str, Any], t_len: int) -> dict[str, Any]:
    """A chunk of one step per stream (``[S, 1, ...]`` arrays) as one step (``[S, ...]``
    views); empty (which the one-step writer refuses) for longer chunks."""
    if t_len != 1:
        return {}
    return {k: v[:, 0] if type(v) is np.ndarray and v.ndim >= 2 else v for k, v in chunk.items()}
