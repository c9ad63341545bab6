"""ReplayBuffer: the single-process buffer of window samples over streams of steps."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardreplay.buffer.batch import Batch
from shardreplay.buffer.checks import (
    as_index_array,
    as_priority_array,
    check_priorities,
    check_stream_ids,
    foreign_key,
    not_prioritized,
)
from shardreplay.buffer.device import batch_on, check_device
from shardreplay.buffer.state import export_state, import_state, state_as_tensors
from shardreplay.buffer.transitions import Transitions, sample_transitions
from shardreplay.errors import ConfigError, EmptyBufferError, InvalidKeyError, SpecMismatchError
from shardreplay.kernels.keys import keys_fit, resolve_keys
from shardreplay.kernels.storage import rows_distinct_in_range
from shardreplay.samplers import (
    SAMPLER_NAMES,
    Draw,
    FifoSampler,
    PrioritizedSampler,
    Sampler,
    UniformSampler,
    as_schedule,
)
from shardreplay.samplers.schedules import Schedule, is_real
from shardreplay.spec import Spec
from shardreplay.spec.keys import MAX_PLACES
from shardreplay.storage import ArrayAllocator, StreamStorage


class ReplayBuffer:
    """Steps of ``num_streams`` streams, sampled as windows of ``window`` steps.

    Each stream is a ring of ``stream_capacity`` steps. A window start is valid when
    its ``window`` steps are stored in one episode, or the episode ends inside it
    (docs/semantics.md, sampling rule 1); only valid starts are drawn.

    Args:
        spec: the fields of a step.
        num_streams: number of streams (environments) writing into this buffer.
        stream_capacity: steps kept per stream (the oldest are overwritten).
        window: steps per sampled window ``L`` (2 for 1-step transitions, n+1 for n-step).
        sampler: ``"uniform"``, ``"prioritized"`` or ``"fifo"``.
        alpha: prioritization exponent (prioritized only).
        beta: importance-weight exponent, a number or a ``LinearSchedule`` over calls.
        seed: seed of the sampling RNG (None: fresh entropy).
        storage: ``"memory"`` (numpy) or ``"memmap"`` (files in ``directory``).
        directory: where memory-mapped arrays live.
        device: where sampled batches land (default CPU). For a CUDA device each batch
            is gathered on the host, pinned and copied with ``non_blocking=True``.

    Raises:
        ConfigError: a setting out of range (the message says which and why).
    """

    def __init__(self, spec: Spec, *, num_streams: int, stream_capacity: int, window: int = 2,
                 sampler: str = "uniform", alpha: float = 0.6, beta: float | Schedule = 0.4,
                 seed: int | None = None, storage: str = "memory",
                 directory: str | Path | None = None, device: torch.device | str | None = None) -> None:
        if not isinstance(spec, Spec):
            raise ConfigError(f"spec must be a shardreplay.Spec, got {type(spec).__name__}")
        _check_sizes(num_streams, stream_capacity, window)
        if sampler not in SAMPLER_NAMES:
            raise ConfigError(f"sampler must be one of {SAMPLER_NAMES}, got {sampler!r}")
        if not is_real(alpha) or not 0.0 <= float(alpha) <= 10.0:
            raise ConfigError(f"alpha must be a number in [0, 10], got {alpha!r}")
        self.device = check_device(device)
        self.spec = spec
        self.window = int(window)
        self.seed = seed
        self._storage = StreamStorage(spec, int(num_streams), int(stream_capacity), self.window,
                                      ArrayAllocator(storage, directory))
        self._sampler: Sampler = _make_sampler(sampler, self._storage, alpha,
                                               as_schedule(beta, "beta", 0.0, 1.0))
        self._rng = np.random.default_rng(seed)
        self.stale_updates = 0

    # -- sizes ----------------------------------------------------------------------------
    @property
    def num_streams(self) -> int:
        """Number of streams (rows)."""
        return self._storage.num_streams

    @property
    def stream_capacity(self) -> int:
        """Steps kept per stream."""
        return self._storage.stream_capacity

    @property
    def capacity(self) -> int:
        """Steps the buffer can hold: ``num_streams * stream_capacity``."""
        return self._storage.size

    @property
    def num_steps(self) -> int:
        """Steps stored now."""
        return self._storage.num_steps

    @property
    def sampler_name(self) -> str:
        """``"uniform"``, ``"prioritized"`` or ``"fifo"``."""
        return self._sampler.name

    def __len__(self) -> int:
        """Valid window starts (for fifo: windows not yet drained)."""
        if isinstance(self._sampler, FifoSampler):
            return self._sampler.num_samplable()
        return self._storage.num_valid

    def __repr__(self) -> str:
        return (f"ReplayBuffer({self.sampler_name}, streams={self.num_streams}x{self.stream_capacity}, "
                f"window={self.window}, len={len(self)}, steps={self.num_steps})")

    # -- writing --------------------------------------------------------------------------
    def add(self, step: Mapping[str, Any], stream_ids: Any = None, priorities: Any = None) -> None:
        """Write one step for each stream (the vector-env case).

        Args:
            step: every spec field plus ``"step_type"`` (and optionally ``"discount"``),
                each with first axis = stream (all streams, or those in ``stream_ids``).
            stream_ids: which streams these rows are (None: all, in order).
            priorities: initial priorities ``[S]`` of the windows starting at these steps.

        Raises:
            SpecMismatchError: the step does not fit the spec, or bad stream ids.
            InvalidPriorityError: priorities of the wrong shape, negative, NaN or inf.
            Nothing is written when an error is raised.
        """
        self._write(step, stream_ids, priorities, t_len=None)

    def extend(self, chunk: Mapping[str, Any], stream_ids: Any = None, priorities: Any = None) -> None:
        """Write ``T`` consecutive steps for each of several streams (the actor-chunk case).

        Same as :meth:`add` with leading axes ``[S, T]``; ``T <= stream_capacity``.

        Raises:
            SpecMismatchError, InvalidPriorityError: as :meth:`add`; nothing is written.
        """
        st = chunk.get("step_type") if isinstance(chunk, Mapping) else None
        shape = np.shape(st) if st is not None else ()
        if len(shape) != 2:
            raise SpecMismatchError(f"extend needs 'step_type' shaped [S, T], got shape {shape}")
        self._write(chunk, stream_ids, priorities, t_len=int(shape[1]))

    def _write(self, step: Mapping[str, Any], stream_ids: Any, priorities: Any,
               t_len: int | None) -> None:
        if stream_ids is None:
            rows = self._storage.all_rows
        elif (type(stream_ids) is np.ndarray and stream_ids.dtype == np.int64 and stream_ids.ndim == 1
              and rows_distinct_in_range(stream_ids, self.num_streams, self._storage.row_marks)):
            rows = stream_ids  # the usual case, checked in one compiled pass
        else:
            rows = check_stream_ids(stream_ids, self.num_streams)  # converts, or raises with the reason
        if t_len is not None and t_len > self.stream_capacity:
            raise SpecMismatchError(f"a chunk of {t_len} steps exceeds stream_capacity "
                                    f"{self.stream_capacity}; split it")
        lead = (rows.shape[0],) if t_len is None else (rows.shape[0], t_len)
        steps = self.spec.validate(step, lead)
        prios = None if priorities is None else check_priorities(priorities, lead)
        sampler = self._sampler
        if prios is not None and isinstance(sampler, PrioritizedSampler):
            sampler.note_priorities(prios)
        slots, valid, newly = self._storage.write(steps, rows, 1 if t_len is None else t_len, prios,
                                                  sampler.default_priority())
        sampler.on_write(slots, valid, newly)

    # -- sampling -------------------------------------------------------------------------
    def sample(self, batch_size: int) -> Batch:
        """Draw ``batch_size`` windows (fifo: at most that many, oldest first).

        Raises:
            ConfigError: ``batch_size`` < 1.
            EmptyBufferError: no valid window can be drawn.
        """
        draw = self.draw(batch_size)
        data, mask, keys = self.gather(draw.starts)
        batch = Batch(data={k: torch.from_numpy(v) for k, v in data.items()},
                      mask=torch.from_numpy(mask), keys=torch.from_numpy(keys),
                      weights=torch.from_numpy(draw.weights),
                      probabilities=torch.from_numpy(draw.probabilities))
        return batch_on(batch, self.device)

    def sample_transitions(self, batch_size: int, gamma: float, n: int | None = None, **names: str
                           ) -> Transitions:
        """Draw ``batch_size`` windows as n-step transitions (obs, action, reward,
        next_obs, bootstrap_discount with gamma applied, weights, keys): see
        :mod:`shardreplay.buffer.transitions`. ``n`` defaults to ``window - 1``;
        ``observation=``, ``action=``, ``reward=`` name the fields.

        Raises:
            ConfigError: ``gamma`` outside [0, 1], ``n`` outside 1 .. window - 1, bad batch size.
            SpecMismatchError: a named field is not in the spec.
            EmptyBufferError: no valid window can be drawn.
        """
        return sample_transitions(self, batch_size, gamma, n, **names)

    def draw(self, batch_size: int, *, advance_schedule: bool = True) -> Draw:
        """Choose window starts without gathering data (used by sharded sampling).

        ``advance_schedule=False`` leaves the beta schedule where it is (the sharded
        buffer advances it once per global sample with :meth:`advance_schedule`).

        Raises:
            ConfigError: ``batch_size`` < 1.
            EmptyBufferError: no valid window can be drawn.
        """
        if not isinstance(batch_size, int | np.integer) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
        if self._sampler.num_samplable() == 0:
            raise EmptyBufferError(
                f"nothing to sample: {self.num_steps} steps stored, 0 valid windows of {self.window} "
                "steps (write more steps, or check that priorities are not all 0)")
        return self._sampler.draw(int(batch_size), self._rng, advance_schedule)

    def advance_schedule(self) -> None:
        """Move the beta schedule one sample call forward without drawing."""
        if isinstance(self._sampler, PrioritizedSampler):
            self._sampler.draws += 1

    def current_beta(self) -> float:
        """The importance-weight exponent of the next ``sample`` call (0 when unweighted)."""
        return self._sampler.current_beta()

    def sampling_stats(self) -> tuple[float, int, float, float]:
        """``(mass, samplable windows, smallest positive leaf, beta now)`` of this shard."""
        s = self._sampler
        return s.mass(), s.num_samplable(), s.min_leaf(), s.current_beta()

    def max_priority(self) -> float:
        """The priority a new start gets when its writer gives none: the largest seen so
        far (prioritized), 1.0 for uniform and fifo sampling."""
        return self._sampler.default_priority()

    def raise_max_priority(self, value: float) -> None:
        """Raise the running maximum priority to ``value`` when it is larger (a sharded
        buffer agrees on the global maximum this way); no effect without priorities."""
        sampler = self._sampler
        if isinstance(sampler, PrioritizedSampler) and math.isfinite(value) and value > sampler.max_priority:
            sampler.max_priority = float(value)

    def gather(self, starts: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """Window data ``[B, L, ...]`` (numpy), mask ``[B, L]`` and keys ``[B]`` (shard 0)
        for flat window starts."""
        return self._storage.windows(starts)

    def gather_into(self, starts: np.ndarray, out: np.ndarray, offsets: Mapping[str, int],
                    dst_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write windows into rows of packed byte records (see ``StreamStorage.windows_into``);
        returns their mask ``[B, L]`` and keys ``[B]`` (shard 0)."""
        return self._storage.windows_into(starts, out, offsets, dst_rows)

    def mass(self) -> float:
        """Sampling mass: valid count (uniform, fifo) or ``sum p^alpha`` (prioritized)."""
        return self._sampler.mass()

    # -- priorities -----------------------------------------------------------------------
    def update_priorities(self, keys: Any, priorities: Any) -> int:
        """Set new priorities for sampled windows.

        Keys whose slot was overwritten since sampling are ignored and counted in
        ``stale_updates``. A key repeated in one call takes its last priority.

        Only a prioritized buffer takes priority updates: on a uniform or fifo buffer
        they would change nothing, so they are refused.

        Returns:
            The number of priorities applied (not stale).

        Raises:
            ConfigError: this buffer's sampler is not ``"prioritized"``.
            InvalidPriorityError: counts differ, or a priority is negative, NaN or inf.
            InvalidKeyError: a key is not a key of this buffer (``torch.arange(B)``, row
                indices, keys of another buffer: see ``spec/keys.py``).
            Nothing changes when an error is raised.
        """
        if not isinstance(self._sampler, PrioritizedSampler):
            raise ConfigError(not_prioritized(self.sampler_name))
        keys = as_index_array(keys, "keys")
        prios = as_priority_array(priorities, keys.shape)
        storage = self._storage
        status, bad, slots, current = resolve_keys(keys, prios, storage.generation, storage.size,
                                                   storage.key_epoch, storage.key_tag)
        if status == 1:
            check_priorities(prios, keys.shape)  # raises with the precise reason
        if status == 2:
            raise InvalidKeyError(foreign_key(keys, bad, "buffer"))
        n_current = int(current.sum())
        self.stale_updates += keys.shape[0] - n_current
        if n_current < keys.shape[0]:
            slots, prios = slots[current], prios[current]
        self._sampler.update(slots, prios)
        return int(slots.shape[0])

    def fits_keys(self, keys: np.ndarray) -> np.ndarray:
        """Which keys (shard 0) are keys of this buffer: its key tag and a place of its
        layout (bool per key; stale keys fit)."""
        keys = np.ascontiguousarray(keys, np.int64)
        return keys_fit(keys, self._storage.key_tag, self.capacity)

    @property
    def key_tag(self) -> int:
        """The tag every key of this buffer carries (see ``spec/keys.py``)."""
        return self._storage.key_tag

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed for an exact restore, laid out by stream and time.

        Returns ``{"meta": dict of numbers, strings, lists and dicts, "arrays": dict of CPU
        tensors}``, so ``torch.save(buffer.state_dict(), path)`` and
        ``torch.load(path, weights_only=True)`` round-trip it. The step arrays hold only
        stored steps, row after row in time order (``episode_id`` is contiguous within a
        row). The buffer's key tag travels too: keys sampled before ``state_dict()`` are
        keys of the buffer that loads it.
        """
        return state_as_tensors(export_state(self, self._storage, self._sampler, self._rng))

    def state_dict_views(self) -> dict[str, Any]:
        """Like :meth:`state_dict`, but each user field is a list of views into storage
        (no copy; valid until the next write). Used to save checkpoints."""
        return export_state(self, self._storage, self._sampler, self._rng, field_views=True)

    @property
    def storage(self) -> StreamStorage:
        """The underlying storage (low level: used by checkpoints to read and write
        arrays without copies; writing to it directly bypasses every check)."""
        return self._storage

    def restore_finished(self, pos: np.ndarray, next_episode_id: int,
                         sampler_state: Mapping[str, Any], rng_state: Mapping[str, Any] | None,
                         stale_updates: int = 0) -> None:
        """Rebuild derived state after :attr:`storage` arrays were filled by a loader.

        Positions, validity and the sampler's trees are recomputed from the stored
        steps; counters, sampler state and (if given) the RNG state are restored.
        """
        self._storage.finish_restore(pos, next_episode_id)
        self._sampler.rebuild()
        self._sampler.load_state_dict(dict(sampler_state))
        if rng_state is not None:
            self._rng.bit_generator.state = dict(rng_state)
        self.stale_updates = int(stale_updates)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` of a buffer with the same layout
        (arrays as tensors, as ``state_dict`` gives them, or numpy arrays).

        Raises:
            ConfigError: the state's layout (streams, capacity, window, sampler) differs;
                use ``shardreplay.checkpoint.load`` to restore onto another layout.
            SpecMismatchError: the state's spec differs from this buffer's.
            Nothing changes when an error is raised.
        """
        import_state(self, self._storage, self._sampler, self._rng, state)


def _check_sizes(num_streams: int, stream_capacity: int, window: int) -> None:
    for name, value in (("num_streams", num_streams), ("stream_capacity", stream_capacity)):
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if int(num_streams) * int(stream_capacity) > MAX_PLACES:
        raise ConfigError(f"num_streams * stream_capacity must be at most {MAX_PLACES:,} steps per "
                          f"buffer (shard), got {num_streams} * {stream_capacity}; use more shards")
    if not isinstance(window, int | np.integer) or window < 1:
        raise ConfigError(f"window must be a positive integer, got {window!r}")
    if window > stream_capacity:
        raise ConfigError(f"window ({window}) must not exceed stream_capacity ({stream_capacity})")


def _make_sampler(name: str, storage: StreamStorage, alpha: float, beta: Schedule) -> Sampler:
    if name == "prioritized":
        return PrioritizedSampler(storage, alpha, beta)
    if name == "fifo":
        return FifoSampler(storage)
    return UniformSampler(storage)
