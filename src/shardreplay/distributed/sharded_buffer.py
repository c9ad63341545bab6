"""ShardedReplayBuffer: K local buffers on K ranks, sampled as one buffer.

Every rank of a ``torch.distributed`` group owns one shard (a :class:`ReplayBuffer`);
writes stay local. ``sample`` and ``update_priorities`` are collective: every rank
calls them in the same order, also when its own shard is empty (docs/semantics.md, sampling rules 5-6).

One ``sample(B)`` of a buffer built with ``mode="exact"`` (the default) is two collectives::

    all_gather   (mass_k, N_k, min_leaf_k, seed, ...)  every rank knows the global picture
                                                       and derives every rank's shard counts
    all_to_all   records (bytes)                       owners send the windows they drew
                 (ranks on one host: owners write them into shared memory, a one-number
                 all_gather says so, and requesters copy their rows out)

A buffer built with ``mode="local"`` needs only the first: each rank draws its batch from its own shard,
and each weight carries the shard factor ``K * mass_k / sum(mass)``, so the
DDP-averaged gradient has the same expectation as in exact mode.

``update_priorities`` applies this shard's keys at once and routes the others in two
all_to_alls (counts, then records): see :mod:`priorities`.

``prefetch=k`` draws ``k`` batches per exchange and queues priority updates for other
shards until the next exchange, so a learner step costs 1/k of the collectives:
``update_priorities`` is then local, and only every k-th ``sample`` is collective.

``pipeline=True`` runs every exchange on a background thread over the buffer's own
process group (made with ``new_group`` at construction, so DDP's all-reduces on the
default group never pair up with it). ``sample`` returns the batches of the exchange
started by the call before it and starts the next one, so the exchange for step t+1
runs while step t trains; ``update_priorities`` is local as with ``prefetch > 1``, and
the queued updates of step t travel with the exchange started at step t+1, before it
draws the batch of step t+2. The ordering argument is in :mod:`background`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from functools import partial
from typing import Any

import numpy as np
import torch

import shardreplay.distributed.global_sampling as gs
from shardreplay.buffer.batch import Batch
from shardreplay.buffer.device import pinned
from shardreplay.buffer.info import BufferInfo
from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.buffer.shard import shard_of_buffer
from shardreplay.buffer.transitions import Transitions, transitions_from_batch
from shardreplay.distributed.agreement import SAMPLE_MODES, check_agreed, settings_of
from shardreplay.distributed.background import Background
from shardreplay.distributed.drawn import Drawn, drawn_weights, padding, split_batches
from shardreplay.distributed.exact_exchange import ExactExchange
from shardreplay.distributed.exchange import window_layout
from shardreplay.distributed.exchange_stats import ExchangeStats, SamplingSettings
from shardreplay.distributed.group import Collectives
from shardreplay.distributed.pending import PendingUpdates
from shardreplay.distributed.pipelined import Pipelining
from shardreplay.distributed.priorities import PriorityRouting
from shardreplay.distributed.shared_records import host_key, nonce
from shardreplay.errors import ConfigError, EmptyBufferError
from shardreplay.spec.keys import MAX_SHARDS, with_shard

# Named in a timeout's message: a lone rank asking len() must learn why it waits.
_SIZES_OP = ("ShardedReplayBuffer.global_sizes (len(), num_steps and capacity are collectives: every "
             "rank must call them at the same point; len(buffer.local) is this rank's shard alone)")
_SETTINGS_OP = ("ShardedReplayBuffer(all_gather settings) (every rank of the group constructs its "
                "buffer at the same point)")


class ShardedReplayBuffer(PriorityRouting, Pipelining):
    """One global buffer over the local shards of a process group.

    Not an ``nn.Module`` and holding no tensors, so keeping it as an attribute of a
    DDP-wrapped module leaves ``named_buffers()`` and ``state_dict()`` untouched.

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
            carry the shard factor); the same on every rank.
        prefetch: batches drawn per exchange (the same on every rank). 1: every
            ``sample`` is one exchange and every ``update_priorities`` lands before it
            returns. ``k > 1``: one exchange serves ``k`` calls, drawn together from the
            distribution at that moment (a batch may miss the priority updates of up to
            ``k - 1`` earlier steps, like a prefetching replay client), and updates for
            other shards are queued until the next exchange: collectives cost 1/k per
            learner step. See docs/semantics.md.
        shared_memory: when every rank runs on one host, exchange sampled records in
            exact mode through ``/dev/shm`` instead of the process group (a copy out of
            the owner's memory instead of TCP loopback). Any rank passing False, or
            unable to create a region, keeps all ranks on the process group. Only for
            CPU (gloo) groups.
        pipeline: run every exchange on a background thread over a process group of
            the buffer's own (created here with ``torch.distributed.new_group``: every
            rank of the default group must construct its buffer at the same point, as
            with any ``new_group``; with ``group`` a subgroup, ranks outside it must
            call ``new_group`` with its ranks at that point too). A batch is then drawn
            one call ahead (up to ``prefetch`` calls ahead), priority updates are
            queued as with ``prefetch > 1``, and every ``sample`` call must ask for the
            same size as the one before. Call :meth:`close` when done. See
            docs/semantics.md for how stale a batch can be.

    Construction is collective: the ranks agree once on the spec, sampler, alpha, beta,
    window, ``mode``, ``prefetch`` and ``pipeline`` (``num_streams`` and ``stream_capacity``
    may differ; see :mod:`agreement`), and on what the same-host exchange needs, so every
    rank of the group must construct its buffer at the same point.

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
        self.local = local_buffer
        self._shard = shard_of_buffer(local_buffer)
        self._comm = Collectives(group, timeout_s)
        if self._comm.world_size > MAX_SHARDS:
            raise ConfigError(f"at most {MAX_SHARDS} shards are supported")
        self.rank = self._comm.rank
        self.world_size = self._comm.world_size
        self.device = torch.device(device) if device is not None else self._comm.device
        seed = local_buffer.seed if seed is None else seed
        self._rng = np.random.default_rng(None if seed is None else [seed, self.rank, 0x5EED])
        self._layout = window_layout(local_buffer.spec, local_buffer.window)
        # Every shard's key tag (0: not known yet), learnt at each exchange and checkpoint
        # load, so keys that are no keys of this buffer are refused where they are passed.
        self._tags = np.zeros(self.world_size, np.int64)
        self.prefetch = int(prefetch)
        self.mode = mode
        # Shared memory is only offered on CPU (gloo) groups.
        use_shm = shared_memory and self._comm.device.type == "cpu"
        mine = settings_of(local_buffer, mode, self.prefetch, pipeline, host_key(use_shm), nonce())
        agreed = SamplingSettings.from_tensor(self._comm.all_gather(mine.to_tensor(), _SETTINGS_OP))
        check_agreed(agreed, local_buffer, self._comm)
        self._ready: deque[Drawn] = deque()
        self._ready_for: tuple[int, str] | None = None
        self._pending = PendingUpdates(self.world_size)
        # Pipelined: the exchanges' own group, used by the background thread alone.
        # The shard is guarded by a lock the thread lets go while a collective is in flight.
        self._lock = threading.Lock()
        self._xcomm = self._comm
        self._background: Background | None = None
        self._inflight: Future | None = None
        self._inflight_for: tuple[int, str] | None = None
        self._closed = False
        if pipeline:
            self._xcomm = self._comm.private_copy()
            self._xcomm.unlocked_while_waiting = self._lock
            self._background = Background(f"shardreplay-exchange-r{self.rank}", self._xcomm.device)
            weakref.finalize(self, self._background.close, 0.0)
        self._exact = ExactExchange(self._shard, self._xcomm, self._layout, agreed.host_key, agreed.nonce)

    @property
    def pipeline(self) -> bool:
        """Whether exchanges run on the background thread (``pipeline=True``)."""
        return self._background is not None

    @property
    def _lazy(self) -> bool:
        """Priority updates for other shards are queued (not routed at once)."""
        return self.prefetch > 1 or self._background is not None

    def _guard(self) -> contextlib.AbstractContextManager:
        """The shard's lock when a background thread shares it, else nothing."""
        return self._lock if self._background is not None else contextlib.nullcontext()

    @property
    def write_lock(self) -> contextlib.AbstractContextManager:
        """Hold this while writing to ``local`` directly (e.g. an ingest loop calling
        ``buffer.local.extend``): with ``pipeline=True`` the background thread draws from
        the shard meanwhile. A no-op context without a pipeline. Never hold it across
        a collective."""
        return self._guard()

    def info(self) -> BufferInfo:
        """Sizes and counters of this rank's shard (not collective): stale updates,
        updates applied here from any rank, routed updates whose keys fit no window here
        (``invalid_keys``), max priority, key tag. Sum over ranks for global figures."""
        with self._guard():
            return self._shard.info()

    @property
    def collectives(self) -> Collectives:
        """The group's collectives (used by checkpoint loading to agree across ranks)."""
        return self._comm

    # -- writes stay local ----------------------------------------------------------------
    def add(self, step: Any, stream_ids: Any = None, priorities: Any = None) -> None:
        """Write one step per stream into this rank's shard (see ReplayBuffer.add)."""
        with self._guard():
            self.local.add(step, stream_ids, priorities)

    def extend(self, chunk: Any, stream_ids: Any = None, priorities: Any = None) -> None:
        """Write ``T`` steps per stream into this rank's shard (see ReplayBuffer.extend)."""
        with self._guard():
            self.local.extend(chunk, stream_ids, priorities)

    # -- global sizes (collective) ----------------------------------------------------------
    def global_sizes(self) -> tuple[int, int, int]:
        """``(len, num_steps, capacity)`` summed over all shards (one collective)."""
        with self._guard():
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

    # -- sampling (collective) ----------------------------------------------------------------
    def sample(self, batch_size: int) -> Batch:
        """Draw ``batch_size`` windows for this rank from the global distribution (in the
        buffer's ``mode``).

        With ``prefetch=k`` one exchange draws ``k`` batches, and the next ``k - 1`` calls
        are served from them without any collective (they must ask for the same
        ``batch_size``). With ``pipeline=True`` the exchange runs on the background
        thread: this call returns a batch the exchange started by an earlier call drew,
        and starts the next exchange when it returns the last prefetched one.

        Raises:
            ConfigError: bad batch size (raised before any collective); a call that differs
                from the prefetched batches' size.
            EmptyBufferError: no shard has a window to draw (on every rank alike).
            CollectiveTimeout: a peer rank did not join in time.
            SamplerFailed: the background thread stopped after an error (pipeline).
        """
        if not isinstance(batch_size, int | np.integer) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
        asked = (int(batch_size), self.mode)
        if self._background is not None:
            return self._sample_pipelined(asked)
        if not self._ready:
            self._ready.extend(self._draw_batches(*asked, self._pending))
            self._ready_for = asked
        self._check_asked(asked)
        return self._serve(self._ready.popleft())

    def sample_transitions(self, batch_size: int, gamma: float, n: int | None = None,
                           **names: str) -> Transitions:
        """:meth:`sample` (collective, same arguments) as n-step transitions, as
        :meth:`ReplayBuffer.sample_transitions` returns them (``bootstrap_discount`` holds
        gamma already).

        Raises:
            ConfigError, EmptyBufferError, CollectiveTimeout: as :meth:`sample`; a bad
                ``gamma`` or ``n`` (after the collective, on every rank alike).
        """
        return transitions_from_batch(self.sample(batch_size), gamma, n, **names)

    def _check_asked(self, asked: tuple[int, str]) -> None:
        if self._ready_for != asked:
            raise ConfigError(
                f"{len(self._ready)} prefetched batches of {self._ready_for} (batch_size, mode) are "
                f"waiting; with prefetch={self.prefetch}{' and pipeline=True' if self.pipeline else ''} "
                f"every sample() call must ask for the same batch_size until they are used "
                f"(got {asked}); discard_prefetched() on every rank drops them")

    def sharding_state(self) -> dict[str, Any]:
        """This rank's own state beside its shard, JSON-ready: the shard-choice RNG (saved
        with a checkpoint part; the max priority is the shard's own, saved with it)."""
        self.settle()  # the background exchange draws from the RNG
        return {"rng": self._rng.bit_generator.state}

    def load_sharding_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`sharding_state` returned (a checkpoint load does this). The
        ``routed_max`` of older checkpoints is ignored: it could hold a priority its owner
        found stale, and the owners' applied maxima are in their shards' sampler state.

        Raises:
            ConfigError: ``state`` is not from :meth:`sharding_state` (nothing changes).
        """
        try:
            scratch = type(self._rng.bit_generator)()
            scratch.state = dict(state["rng"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError("not a sharding state from ShardedReplayBuffer.sharding_state(): "
                              f"{exc!r}") from exc
        self._rng.bit_generator.state = scratch.state

    @property
    def prefetched(self) -> int:
        """Batches drawn by the last exchange and not yet returned by :meth:`sample`."""
        return len(self._ready)

    def discard_prefetched(self) -> None:
        """Drop the prefetched batches and the queued updates (no collective): what they
        name is gone once the shard's content is replaced, e.g. by a checkpoint load.
        With ``pipeline=True`` the exchange in flight is waited for and dropped too
        (every rank must call this at the same point, as a load does)."""
        self.settle()
        self._ready.clear()
        self._ready_for = None
        self._pending.take()

    @property
    def pending_updates(self) -> int:
        """Priority updates for other shards queued here (``prefetch > 1``) until the next
        exchange."""
        return len(self._pending)

    def flush_updates(self) -> int:
        """Route the queued updates of ``prefetch > 1`` / ``pipeline=True`` to their
        owners now (collective: every rank calls it at the same point, e.g. before a
        checkpoint). With a pipeline, the exchange in flight finishes first (its batches
        stay prefetched) and the flush runs on the background thread.

        Returns:
            The number of updates this rank's shard applied.

        Raises:
            CollectiveTimeout: a peer rank did not join in time.
            SamplerFailed: the background thread stopped after an error (pipeline).
        """
        if self._background is None:
            return self._flush(self._pending.detach())
        if self._inflight is not None:
            self._collect()
        job = partial(self._locked, self._flush, self._pending.detach())
        return int(self._background.wait(self._background.submit(job)))

    def _draw_batches(self, n: int, mode: str, pending: PendingUpdates) -> list[Drawn]:
        """One exchange: route ``pending`` (and the others' queued updates), agree on the
        global picture, draw ``prefetch`` batches (exact: fetch them from their owners).

        In local mode this shard's draw needs nothing from the other ranks, so it runs
        while the stats are in flight (unless queued updates must land first)."""
        own: list[Any] = []
        early = None
        if mode == "local" and not len(pending):
            def early() -> None:
                own.append(self._draw_own(n * self.prefetch))
        stats = self._gather_stats(n, pending, early)
        self.learn_key_tags(stats.key_tag)
        foreign = stats.tail
        if foreign.any():  # queued priority updates first, so the draw sees them
            self._route(pending.take()[0], foreign)
            stats, own = self._gather_stats(n, pending), []
        self._shard.raise_max_priority(float(stats.max_priority.max()))
        masses, counts = stats.mass, stats.samplable
        if counts.sum() == 0 or masses.sum() <= 0:
            raise EmptyBufferError("no shard has a window to sample: write more steps first")
        total, low = float(masses.sum()), float(stats.min_leaf.min())
        if mode == "local":
            drawn = self._draw_local(n, masses, total, low, own[0] if own else None)
        else:
            drawn = self._exact.draw(masses, stats.batch_size, int(stats.seed[0]), self.prefetch, total, low)
        return drawn

    def _gather_stats(self, batch_size: int, pending: PendingUpdates,
                      while_waiting: Callable[[], None] | None = None) -> ExchangeStats:
        """Every rank's :class:`ExchangeStats` (as ``[K]`` columns)."""
        st = self._shard.stats()
        mine = ExchangeStats(st.mass, st.samplable, st.min_leaf, batch_size,
                             int(self._rng.integers(0, 1 << 63)), self._max_seen(), st.key_tag,
                             pending.counts)
        rows = self._xcomm.all_gather(mine.to_tensor(), "ShardedReplayBuffer.sample(all_gather stats)",
                                      while_waiting=while_waiting)
        return ExchangeStats.from_tensor(rows)

    def _draw_own(self, m: int) -> tuple[Any, ...] | None:
        """``m`` windows of this shard (as :meth:`_draw_windows`), or None when it is empty."""
        st = self._shard.stats()
        if st.samplable == 0 or st.mass <= 0:
            return None
        return self._draw_windows(m)

    def _draw_windows(self, m: int) -> tuple[Any, ...]:
        """``m`` windows of this shard, which has some: (draw, data, mask, keys)."""
        draw = self._shard.draw(m, advance_schedule=False)
        return (draw, *self._shard.gather(draw.starts))

    def _draw_local(self, n: int, masses: np.ndarray, total: float, low: float,
                    own: tuple[Any, ...] | None) -> list[Drawn]:
        mass_k, k = masses[self.rank], self.prefetch
        if mass_k <= 0:
            return [padding(self._layout, self.local.window, n) for _ in range(k)]
        draw, data, mask, keys = own if own is not None else self._draw_windows(k * n)  # mass_k > 0
        prob = gs.global_probabilities(draw.probabilities, mass_k, total)
        tensors = {name: torch.from_numpy(v) for name, v in data.items()}
        return split_batches(tensors, torch.from_numpy(mask), torch.from_numpy(with_shard(keys, self.rank)),
                             torch.from_numpy(prob), n, total, low, self.world_size * mass_k / total,
                             self._shard.current_beta())

    def _serve(self, d: Drawn) -> Batch:
        """A prefetched draw as a Batch, weighted with beta at this call (the schedule
        advances once per sample() call, prefetched or not)."""
        beta = self._shard.current_beta()
        self._shard.advance_schedule()
        weights = d.weights if beta == d.beta else drawn_weights(d.prob, d.total, d.low, beta, d.factor)
        batch = Batch(data=d.data, mask=d.mask, keys=d.keys, weights=weights, probabilities=d.prob)
        if batch.keys.device == self.device:
            return batch
        if self.device.type == "cuda" and batch.keys.device.type == "cpu":
            return pinned(batch).to(self.device, non_blocking=True)
        return batch.to(self.device)

