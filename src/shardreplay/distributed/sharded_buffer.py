"""ShardedReplayBuffer: K local buffers on K ranks, sampled as one buffer.

Every rank of a ``torch.distributed`` group owns one shard (a :class:`ReplayBuffer`);
writes stay local. ``sample`` and ``update_priorities`` are collective: every rank calls
them in the same order, also when its own shard is empty (docs/semantics.md, sampling
rules 5-6). The buffer is a facade over the priority router (:mod:`priorities`), the
exchange (:mod:`exchange` with the mode's strategy) and the runner (:mod:`runner`:
inline, or a background thread); checkpoints reach them through :func:`internals_of`.

Every public method's docstring says whether it is collective; the collectives of an
exchange, their bytes and round trips: docs/multi-machine.md, "How far exact sampling
scales" (``tests/distributed/test_sharded_collectives.py`` counts them per call).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Literal, overload

import numpy as np
import torch

from shardreplay.buffer.batch import Batch, BufferInfo
from shardreplay.buffer.device import pinned, pins, records_on
from shardreplay.buffer.nstep import Transitions, nstep_transitions
from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.buffer.shard import shard_of_buffer
from shardreplay.buffer.tensordicts import tensordict_gamma, transition_names
from shardreplay.distributed.agreement import SAMPLE_MODES, check_agreed, settings_of
from shardreplay.distributed.exact_exchange import ExactExchange
from shardreplay.distributed.exchange import (
    Drawn,
    ExchangeStrategy,
    LocalExchange,
    Refill,
    SamplingSettings,
    drawn_weights,
)
from shardreplay.distributed.group import Collectives
from shardreplay.distributed.priorities import PriorityRouter
from shardreplay.distributed.runner import BackgroundRunner, InlineRunner
from shardreplay.distributed.same_host import SameHost, host_key, nonce
from shardreplay.errors import ConfigError
from shardreplay.spec.keys import MAX_SHARDS
from shardreplay.spec.layout import window_layout

__all__ = ["SAMPLE_MODES", "ShardedReplayBuffer", "internals_of"]

# Named in a timeout's message: a lone rank asking len() must learn why it waits.
_SIZES_OP = ("ShardedReplayBuffer.global_sizes (len(), num_steps and capacity are collectives: every "
             "rank must call them at the same point; len(buffer.local) is this rank's shard alone)")
_SETTINGS_OP = ("ShardedReplayBuffer(all_gather settings) (every rank of the group constructs its "
                "buffer at the same point)")


class ShardedReplayBuffer:
    """One global buffer over the local shards of a process group.

    Holds no tensors: as an attribute of a DDP-wrapped module it leaves ``state_dict()``
    untouched.

    Args:
        local_buffer: this rank's shard (uniform or prioritized).
        group: the process group (None: the default group).
        timeout_s: how long a collective waits for the other ranks.
        device: where sampled batches are returned (default: the group's device,
            CPU for gloo, the current CUDA device for NCCL).
        seed: seed of this rank's shard-choice RNG (default: the local buffer's seed),
            combined with the rank so ranks draw differently.
        mode: ``"exact"`` (every batch drawn from the global distribution, items fetched
            from their owners) or ``"local"`` (each rank draws from its own shard, weights
            carry the shard factor ``K * mass_k / sum(mass)``).
        prefetch: batches drawn per exchange; with ``k > 1`` one exchange serves ``k``
            calls, and updates for other shards wait for the next exchange.
        shared_memory: when every rank runs on one host (gloo), run the exchanges'
            collectives and move exact mode's sampled records through ``/dev/shm``
            instead of the process group; on several hosts, a host's ranks through it and
            one leader per host over a gloo ``new_group`` of the leaders. Any rank passing
            False, or unable to create a region, keeps all on the group.
        pipeline: run every exchange a call ahead on a background thread, through shared
            memory or over a process group of the buffer's own (``new_group``: every
            rank of the default group builds its buffer at the same point); :meth:`close`
            it when done.
            docs/semantics.md, "Sharded sampling", says how stale a batch can be.

    Construction is collective: the ranks agree once on the spec, sampler, alpha, beta,
    window, ``mode``, ``prefetch`` and ``pipeline`` (see :mod:`agreement`).

    Raises:
        ConfigError: torch.distributed not initialised, a fifo shard, too many ranks,
            prefetch < 1, an unknown mode; ranks whose specs or settings differ (raised
            on every rank alike, naming the first field that differs).
        CollectiveTimeout: a rank did not construct its buffer in time, or (with
            ``pipeline=True``) did not join the new group.
    """

    def __init__(self, local_buffer: ReplayBuffer, group: Any = None, *, timeout_s: float = 60.0,
                 device: torch.device | str | None = None, seed: int | None = None,
                 prefetch: int = 1, shared_memory: bool = True, pipeline: bool = False,
                 mode: str = "exact") -> None:
        if not isinstance(local_buffer, ReplayBuffer):
            raise ConfigError("local_buffer must be a shardreplay.ReplayBuffer")
        if local_buffer.sampler_name == "fifo":
            raise ConfigError("a sharded buffer samples uniform or prioritized shards, not fifo")
        if not isinstance(prefetch, int | np.integer) or prefetch < 1:
            raise ConfigError(f"prefetch must be a positive integer, got {prefetch!r}")
        if mode not in SAMPLE_MODES:
            raise ConfigError(f"mode must be one of {SAMPLE_MODES}, got {mode!r}")
        self.local, shard = local_buffer, shard_of_buffer(local_buffer)
        comm = Collectives(group, timeout_s)
        if comm.world_size > MAX_SHARDS:
            raise ConfigError(f"at most {MAX_SHARDS} shards are supported")
        self.rank, self.world_size = comm.rank, comm.world_size
        self.device = torch.device(device) if device is not None else comm.device
        self.prefetch, self.mode = int(prefetch), mode
        seed = local_buffer.seed if seed is None else seed
        choice = np.random.default_rng(None if seed is None else [seed, self.rank, 0x5EED])
        region_nonce, host = nonce(), None
        if shared_memory and comm.device.type == "cpu" and self.world_size > 1:  # gloo groups only
            with contextlib.suppress(OSError):  # no region: this rank's host key is its own
                host = SameHost(region_nonce, self.rank, self.world_size)
        mine = settings_of(local_buffer, mode, self.prefetch, pipeline, host_key(host is not None),
                           region_nonce if host is not None else -1)
        agreed = SamplingSettings.from_rows(comm.all_gather(mine.to_row(), _SETTINGS_OP))
        check_agreed(agreed, local_buffer, comm)
        # The exchanges' own group: shared memory when every rank has a region and some share a
        # host (all: exact mode's records go there too), else gloo (a new group for the thread).
        keys = agreed.host_key.tolist()
        xcomm = (comm.shared_copy(host, agreed.nonce, keys)
                 if host is not None and (agreed.nonce >= 0).all() and len(set(keys)) < len(keys)
                 else comm.private_copy() if pipeline else comm)
        layout = window_layout(local_buffer.spec, local_buffer.window)
        strategy: ExchangeStrategy = (
            ExactExchange(shard, xcomm, layout, pin=pins(self.device)) if mode == "exact"
            else LocalExchange(shard, layout, local_buffer.window, self.rank, self.world_size))
        router = PriorityRouter(shard, xcomm)
        refill = Refill(shard, xcomm, router, strategy, self.prefetch, choice)
        runner = (BackgroundRunner(refill, router, xcomm, f"shardreplay-exchange-r{self.rank}")
                  if pipeline else InlineRunner(refill, router))
        self._shard, self._comm, self._router, self._runner = shard, comm, router, runner
        self._layout = layout
        self._internals = ShardedInternals(comm, xcomm, router, choice, runner, strategy)

    @property
    def pipeline(self) -> bool:
        """Whether exchanges run on the background thread (``pipeline=True``)."""
        return self._runner.pipeline

    @property
    def window(self) -> int:
        """Steps per sampled window (every rank's is the same: checked at construction)."""
        return self.local.window

    @property
    def period(self) -> int:
        """Steps between window starts in an episode (the same on every rank)."""
        return self.local.period

    @property
    def write_lock(self) -> contextlib.AbstractContextManager:
        """Hold this while writing to ``local`` directly (the pipeline's thread draws from
        the shard meanwhile; a no-op without one). Never hold it across a collective."""
        return self._runner.guard()

    def info(self) -> BufferInfo:
        """Sizes and counters of this rank's shard (not collective): stale updates,
        updates applied here from any rank, routed updates whose keys fit no window here
        (``invalid_keys``), max priority, key tag. Sum over ranks for global figures."""
        with self._runner.guard():
            return self._shard.info()

    def add(self, step: Any, stream_ids: Any = None, priorities: Any = None) -> None:
        """Write one step per stream into this rank's shard (see ReplayBuffer.add); no collective."""
        with self._runner.guard():
            self.local.add(step, stream_ids, priorities)

    def extend(self, chunk: Any, stream_ids: Any = None, priorities: Any = None) -> None:
        """Write ``T`` steps per stream into this rank's shard (see ReplayBuffer.extend); no collective."""
        with self._runner.guard():
            self.local.extend(chunk, stream_ids, priorities)

    def global_sizes(self) -> tuple[int, int, int]:
        """``(len, num_steps, capacity)`` summed over all shards (one collective)."""
        with self._runner.guard():
            local = torch.tensor([len(self.local), self.local.num_steps, self.local.capacity],
                                 dtype=torch.int64)
        total = self._comm.all_reduce_sum(local, _SIZES_OP).cpu()
        return int(total[0]), int(total[1]), int(total[2])

    def __len__(self) -> int:
        """Valid windows over all shards (collective: every rank must call it)."""
        return self.global_sizes()[0]

    @property
    def num_steps(self) -> int:
        """Stored steps over all shards (collective)."""
        return self.global_sizes()[1]

    @property
    def capacity(self) -> int:
        """Capacity in steps over all shards (collective)."""
        return self.global_sizes()[2]

    @overload
    def sample(self, batch_size: int, *, as_tensordict: Literal[False] = False,
               gamma: None = None) -> Batch: ...

    @overload
    def sample(self, batch_size: int, *, as_tensordict: Literal[True], gamma: float | None = None) -> Any: ...

    def sample(self, batch_size: int, *, as_tensordict: bool = False, gamma: float | None = None) -> Any:
        """Draw ``batch_size`` windows for this rank from the global distribution (in the
        buffer's ``mode``); ``as_tensordict`` and ``gamma`` as in :meth:`ReplayBuffer.sample`.
        With ``prefetch=k`` the next ``k - 1`` calls are served from the batches one
        exchange drew (same ``batch_size``); with ``pipeline=True`` the exchange an earlier
        call started drew it.

        Raises:
            ConfigError: bad batch size, or ``as_tensordict`` without a needed ``gamma``
                (raised before any collective); a call that differs from the prefetched
                batches' size.
            EmptyBufferError: no shard has a window to draw (on every rank alike).
            CollectiveTimeout: a peer rank did not join in time.
            SamplerFailed: the background thread stopped after an error (pipeline).
        """
        if not isinstance(batch_size, int | np.integer) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not as_tensordict:
            if gamma is not None:
                raise ConfigError("gamma is for sample(..., as_tensordict=True)")
            return self._runner.next((int(batch_size), self.mode), self._serve)
        window = self.local.window
        gamma = tensordict_gamma(gamma, window)  # checked before the collective: ranks raise alike
        batch = self._runner.next((int(batch_size), self.mode), self._serve)
        return nstep_transitions(batch, gamma, window - 1, **transition_names(self.local.spec),
                                 validate=False).to_tensordict()

    def sample_transitions(self, batch_size: int, gamma: float, n: int | None = None,
                           **names: str) -> Transitions:
        """:meth:`sample` (collective, same arguments) as n-step transitions, as
        :meth:`ReplayBuffer.sample_transitions` returns them (``bootstrap_discount`` holds
        gamma already).

        Raises:
            ConfigError, EmptyBufferError, CollectiveTimeout: as :meth:`sample`; a bad
                ``gamma`` or ``n`` (after the collective, on every rank alike).
        """
        return nstep_transitions(self.sample(batch_size), gamma, n, **names, validate=False)

    def update_priorities(self, keys: Any, priorities: Any) -> int:
        """Route each priority to the shard that owns its key: collective in exact mode
        with ``prefetch=1`` and no pipeline, else local (the other shards' updates wait for
        the next exchange or :meth:`flush_updates`; docs/semantics.md, "Sharded sampling").
        Keys of -1 (padding) are skipped; stale keys are counted on the owner.

        Returns:
            The number of updates this rank's shard applied in this call (from any rank
            when collective; its own otherwise).

        Raises:
            ConfigError: the shards are not prioritized (priorities would change nothing).
            InvalidPriorityError / InvalidKeyError: this rank's input was bad (nothing of
                it applied or queued; when collective it still joined, so no peer hangs).
            CollectiveTimeout: a peer rank did not join in time.
        """
        if self.prefetch == 1 and not self.pipeline and self.mode == "exact":
            return self._router.update_now(keys, priorities)
        with self._runner.guard():  # the background exchange reads and writes the shard too
            return self._router.queue(keys, priorities)

    @property
    def pending_updates(self) -> int:
        """Priority updates for other shards queued here (``prefetch > 1``) until the next
        exchange."""
        return len(self._router.pending)

    def flush_updates(self) -> int:
        """Route the queued updates to their owners now (collective, e.g. before a
        checkpoint); with a pipeline the exchange in flight finishes first.

        Returns:
            The number of updates this rank's shard applied.

        Raises:
            CollectiveTimeout: a peer rank did not join in time.
            SamplerFailed: the background thread stopped after an error (pipeline).
        """
        return self._runner.flush()

    @property
    def prefetched(self) -> int:
        """Batches drawn by the last exchange and not yet returned by :meth:`sample`."""
        return self._runner.prefetched

    def discard_prefetched(self) -> None:
        """Drop the prefetched batches and the queued updates, and (pipeline) the exchange
        in flight once it ends; no collective, but every rank at the same point."""
        self._runner.discard()

    def settle(self) -> None:
        """Wait for the background exchange in flight, if any (its batches stay
        prefetched); then nothing touches the shard until the next call. Not collective;
        raises nothing (the next call that needs it raises the error)."""
        self._runner.settle()

    def close(self) -> None:
        """Stop the background thread (after the exchange in flight) and release the
        buffer's own process group; idempotent, a no-op without a pipeline. Every rank
        should close at the same point. Later ``sample`` calls raise ConfigError."""
        self._runner.close()

    def __enter__(self) -> ShardedReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self, d: Drawn) -> Batch:
        """A prefetched draw as a Batch, weighted with this call's beta."""
        beta = self._shard.current_beta()
        self._shard.advance_schedule()
        weights = d.weights if beta == d.beta else drawn_weights(d.prob.numpy(), d.total, d.low, beta,
                                                                 d.factor)
        batch = Batch(data=d.data, mask=d.mask, keys=d.keys, weights=weights, probabilities=d.prob)
        if batch.keys.device == self.device:
            return batch
        if self.device.type == "cuda" and batch.keys.device.type == "cpu":
            if d.records is not None:
                return records_on(d.records, self._layout, weights, self.device)
            return pinned(batch).to(self.device, non_blocking=True)
        return batch.to(self.device)


@dataclass
class ShardedInternals:
    """What checkpoints, the runtime and tests reach behind a :class:`ShardedReplayBuffer`'s
    public surface (:func:`internals_of`).

    Attributes:
        collectives: the caller's group (loads agree on it).
        exchange_group: the group exchanges run on (the buffer's own when pipelined).
        router: the priority router (queued updates, key tags).
        choice: the shard-choice RNG (saved with a checkpoint part).
        runner: inline or background (lock, thread, prefetched batches).
        strategy: the mode's exchange strategy.
    """

    collectives: Collectives
    exchange_group: Collectives
    router: PriorityRouter
    choice: np.random.Generator
    runner: InlineRunner
    strategy: ExchangeStrategy

    def sharding_state(self) -> dict[str, Any]:
        """The shard-choice RNG's state, JSON-ready (saved with a checkpoint part), once a
        background exchange (which draws from it) has ended."""
        self.runner.settle()
        return {"rng": self.choice.bit_generator.state}

    def load_sharding_state(self, state: Any) -> None:
        """Restore what :meth:`sharding_state` returned (the ``routed_max`` older checkpoints
        saved beside it is ignored: docs/semantics.md, "Checkpoints").

        Raises:
            ConfigError: ``state`` is not from :meth:`sharding_state` (nothing changes).
        """
        try:
            scratch = type(self.choice.bit_generator)()
            scratch.state = dict(state["rng"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError("not a sharding state from internals_of(buffer).sharding_state(): "
                              f"{exc!r}") from exc
        self.choice.bit_generator.state = scratch.state


def internals_of(buffer: ShardedReplayBuffer) -> ShardedInternals:
    """The :class:`ShardedInternals` behind ``buffer``."""
    return buffer._internals
