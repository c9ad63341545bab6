"""ReplayBuffer: the single-process buffer of window samples over streams of steps."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import torch

from shardreplay.buffer.batch import Batch, BufferInfo
from shardreplay.buffer.checks import as_index_array, as_priority_array, check_stream_ids, not_prioritized
from shardreplay.buffer.device import check_device, gathered_on, pins
from shardreplay.buffer.nstep import Transitions
from shardreplay.buffer.shard import Shard
from shardreplay.buffer.state import export_state, import_state, state_as_tensors
from shardreplay.buffer.tensordicts import (
    is_tensordict,
    tensordict_gamma,
    tensordict_writes,
    transition_names,
)
from shardreplay.buffer.transitions import sample_transitions
from shardreplay.errors import ConfigError, SpecMismatchError
from shardreplay.samplers import SAMPLER_NAMES, PrioritizedSampler, as_schedule
from shardreplay.samplers.schedules import Schedule, is_real
from shardreplay.spec import Spec
from shardreplay.spec.fields import StepType
from shardreplay.spec.keys import MAX_PLACES
from shardreplay.spec.layout import window_layout

LAST = int(StepType.LAST)


class ReplayBuffer:
    """Steps of ``num_streams`` streams, sampled as windows of ``window`` steps.

    Each stream is a ring of ``stream_capacity`` steps. A window start is valid when
    its ``window`` steps are stored in one episode, or the episode ends inside it
    (docs/semantics.md, sampling rule 1); only valid starts are drawn.

    Args:
        spec: the fields of a step.
        num_streams: number of streams (environments) writing into this buffer.
        stream_capacity: steps kept per stream (the oldest are overwritten).
        window: steps per sampled window ``L`` (2 for 1-step transitions, n+1 for n-step,
            the sequence length for recurrent learners).
        period: window starts lie every ``period`` steps of an episode, ``1 <= period <=
            window`` (1, the default: every step; R2D2's overlapping sequences:
            docs/semantics.md, "Sequence windows").
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
                 directory: str | Path | None = None, device: torch.device | str | None = None,
                 period: int = 1) -> None:
        if not isinstance(spec, Spec):
            raise ConfigError(f"spec must be a shardreplay.Spec, got {type(spec).__name__}")
        _check_sizes(num_streams, stream_capacity, window)
        if not isinstance(period, int | np.integer) or isinstance(period, bool) or not 1 <= period <= window:
            raise ConfigError(f"period must be an integer in [1, window={window}], got {period!r} "
                              "(windows start every `period` steps of an episode)")
        if sampler not in SAMPLER_NAMES:
            raise ConfigError(f"sampler must be one of {SAMPLER_NAMES}, got {sampler!r}")
        if not is_real(alpha) or not 0.0 <= float(alpha) <= 10.0:
            raise ConfigError(f"alpha must be a number in [0, 10], got {alpha!r}")
        self.device = check_device(device)
        self.spec = spec
        self.window = int(window)
        self.seed = seed
        # Storage, sampler, RNG and keys: the internal seam (see buffer/shard.py).
        self._shard = Shard(spec, int(num_streams), int(stream_capacity), self.window, sampler, alpha,
                            as_schedule(beta, "beta", 0.0, 1.0), seed, storage, directory, int(period))
        # Batches for a GPU are gathered into page-locked records of this layout.
        self._gpu_records = window_layout(self.spec, self.window) if pins(self.device) else None

    # -- sizes ----------------------------------------------------------------------------
    @property
    def num_streams(self) -> int:
        """Number of streams (rows)."""
        return self._shard.num_streams

    @property
    def stream_capacity(self) -> int:
        """Steps kept per stream."""
        return self._shard.stream_capacity

    @property
    def capacity(self) -> int:
        """Steps the buffer can hold: ``num_streams * stream_capacity``."""
        return self._shard.capacity

    @property
    def num_steps(self) -> int:
        """Steps stored now."""
        return self._shard.num_steps

    @property
    def period(self) -> int:
        """Steps between window starts within an episode (1: every step)."""
        return self._shard.period

    @property
    def sampler_name(self) -> str:
        """``"uniform"``, ``"prioritized"`` or ``"fifo"``."""
        return self._shard.sampler_name

    def __len__(self) -> int:
        """Valid window starts (for fifo: windows not yet drained)."""
        return self._shard.samplable()

    def __repr__(self) -> str:
        period = f", period={self.period}" if self.period > 1 else ""
        return (f"ReplayBuffer({self.sampler_name}, streams={self.num_streams}x{self.stream_capacity}, "
                f"window={self.window}{period}, len={len(self)}, steps={self.num_steps})")

    # -- writing --------------------------------------------------------------------------
    def add(self, step: Mapping[str, Any], stream_ids: Any = None, priorities: Any = None) -> None:
        """Write one step for each stream (the vector-env case).

        Args:
            step: every spec field plus ``"step_type"`` (and optionally ``"discount"``),
                each with first axis = stream (all streams, or those in ``stream_ids``);
                or a ``tensordict.TensorDict`` of those, or of TorchRL transitions
                (``observation``, ``action``, ``("next", "reward" / "observation" /
                "terminated" / "truncated")``), ``batch_size [S]``, stored by the rule
                of :mod:`shardreplay.buffer.tensordicts` (an ended episode's LAST step
                is written after its row).
            stream_ids: which streams these rows are (None: all, in order).
            priorities: initial priorities ``[S]`` of the windows starting at these steps.

        Raises:
            SpecMismatchError: the step does not fit the spec, or bad stream ids.
            InvalidPriorityError: priorities of the wrong shape, negative, NaN or inf.
            Nothing is written when an error is raised.
        """
        if type(step) is not dict and is_tensordict(step):
            self._write_tensordict(step, stream_ids, priorities, 1)
            return
        self._shard.write(step, stream_ids, priorities, None)

    def extend(self, chunk: Mapping[str, Any], stream_ids: Any = None, priorities: Any = None) -> None:
        """Write ``T`` consecutive steps for each of several streams (the actor-chunk case).

        Same as :meth:`add` with leading axes ``[S, T]``; ``T <= stream_capacity``. A
        TensorDict of TorchRL transitions is ``[S, T]`` (time last: ``data.unsqueeze(0)``
        for a collector's ``[T]``); successive calls continue each stream.

        Raises:
            SpecMismatchError, InvalidPriorityError: as :meth:`add`; nothing is written.
        """
        if is_tensordict(chunk):
            self._write_tensordict(chunk, stream_ids, priorities, 2)
            return
        st = chunk.get("step_type") if isinstance(chunk, Mapping) else None
        shape = np.shape(st) if st is not None else ()
        if len(shape) != 2:
            raise SpecMismatchError(f"extend needs 'step_type' shaped [S, T], got shape {shape}")
        self._shard.write(chunk, stream_ids, priorities, int(shape[1]))

    def _write_tensordict(self, td: Any, stream_ids: Any, priorities: Any, lead_ndim: int) -> None:
        """Store a TensorDict (:mod:`shardreplay.buffer.tensordicts` says how)."""
        rows = None if stream_ids is None else check_stream_ids(stream_ids, self.num_streams)

        def fresh() -> np.ndarray:
            return self._fresh_streams() if rows is None else self._fresh_streams()[rows]

        writes = []
        for steps, ids, prios in tensordict_writes(td, self.spec, lead_ndim, priorities, fresh):
            lead = steps["step_type"].shape
            # Every write checked before the first is made (sealed: not checked again), so
            # that a bad value in any stream writes nothing.
            writes.append((self.spec.validated(steps, lead), rows if ids is None else
                           (ids if rows is None else rows[ids]), prios, None if lead_ndim == 1 else lead[1]))
        for checked, target, prios, t_len in writes:
            self._shard.write_full(checked, target, prios, t_len)

    def _fresh_streams(self) -> np.ndarray:
        """Per stream, whether its next step starts an episode: nothing stored yet, or its
        latest step is a LAST."""
        storage = self._shard._storage
        pos, cap = storage.pos, storage.stream_capacity
        latest = np.arange(len(pos)) * cap + (pos - 1) % cap
        return (pos == 0) | (storage.step_type[latest] == LAST)

    # -- sampling -------------------------------------------------------------------------
    @overload
    def sample(self, batch_size: int, *, as_tensordict: Literal[False] = False,
               gamma: None = None) -> Batch: ...

    @overload
    def sample(self, batch_size: int, *, as_tensordict: Literal[True], gamma: float | None = None) -> Any: ...

    def sample(self, batch_size: int, *, as_tensordict: bool = False, gamma: float | None = None) -> Any:
        """Draw ``batch_size`` windows (fifo: at most that many, oldest first) as a
        :class:`Batch`, or with ``as_tensordict=True`` as one TensorDict of n-step
        transitions (``n = window - 1``) with TorchRL's names, which a TorchRL loss built
        with the same ``gamma`` (needed for ``window > 2``) takes unchanged (docs/porting.md;
        needs the ``tensordict`` package).

        Raises:
            ConfigError: ``batch_size`` < 1; ``as_tensordict`` without ``gamma`` for
                ``window > 2``, or without the tensordict package.
            EmptyBufferError: no valid window can be drawn.
        """
        if as_tensordict:
            gamma = tensordict_gamma(gamma, self.window)
            names = transition_names(self.spec)
            tr = self.sample_transitions(batch_size, gamma, self.window - 1, **names)
            if self.device.type != "cpu":
                tr = tr.to(self.device, non_blocking=True)
            return tr.to_tensordict()
        if gamma is not None:
            raise ConfigError("gamma is for sample(..., as_tensordict=True); sample_transitions takes it too")
        shard = self._shard
        draw = shard.draw(batch_size)
        if self._gpu_records is not None:
            return gathered_on(shard, draw, self._gpu_records, self.device)
        data, mask, keys = shard.gather(draw.starts)
        batch = Batch(data={k: torch.from_numpy(v) for k, v in data.items()},
                      mask=torch.from_numpy(mask), keys=torch.from_numpy(keys),
                      weights=torch.from_numpy(draw.weights),
                      probabilities=torch.from_numpy(draw.probabilities))
        return batch if self.device.type == "cpu" else batch.to(self.device)  # CUDA took the records above

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
        return sample_transitions(self._shard, batch_size, gamma, n, **names)

    # -- priorities -----------------------------------------------------------------------
    def update_priorities(self, keys: Any, priorities: Any) -> int:
        """Set new priorities for sampled windows.

        Keys whose slot was overwritten since sampling are ignored and counted in
        ``info().stale_updates``. A key repeated in one call takes its last priority.

        Returns:
            The number of priorities applied (not stale).

        Raises:
            ConfigError: this buffer's sampler is not ``"prioritized"``.
            InvalidPriorityError: counts differ, or a priority is negative, NaN or inf.
            InvalidKeyError: a key is not a key of this buffer (``torch.arange(B)``, row
                indices, keys of another buffer: see ``spec/keys.py``).
            Nothing changes when an error is raised.
        """
        shard = self._shard
        if not isinstance(shard._sampler, PrioritizedSampler):
            raise ConfigError(not_prioritized(self.sampler_name))
        keys = as_index_array(keys, "keys")
        return shard.apply_priorities(keys, as_priority_array(priorities, keys.shape))

    def info(self) -> BufferInfo:
        """Sizes and counters (stale and applied priority updates, max priority, key tag)
        as one :class:`~shardreplay.BufferInfo` record."""
        return self._shard.info()

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed for an exact restore, as ``{"meta": ..., "arrays": CPU tensors}``
        that ``torch.save`` and ``torch.load(path, weights_only=True)`` round-trip
        (docs/semantics.md, "Saving a buffer, and where batches land"). The key tag travels
        too: keys sampled before ``state_dict()`` are keys of the buffer that loads it."""
        return state_as_tensors(export_state(self._shard))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` of a buffer with the same layout
        (arrays as tensors, as ``state_dict`` gives them, or numpy arrays).

        Raises:
            ConfigError: the state's layout (streams, capacity, window, sampler) differs;
                use ``shardreplay.checkpoint.load`` to restore onto another layout.
            SpecMismatchError: the state's spec differs from this buffer's.
            Nothing changes when an error is raised.

        Waits first for a background checkpoint of this buffer to finish writing.
        """
        self._shard.wait_saved()
        import_state(self._shard, state)


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
