"""ShardedReplayBuffer: K local buffers on K ranks, sampled as one buffer.

Every rank of a ``torch.distributed`` group owns one shard (a :class:`ReplayBuffer`);
writes stay local. ``sample`` and ``update_priorities`` are collective: every rank
calls them in the same order, also when its own shard is empty (DESIGN.md rules 5-6).

One ``sample(B, mode="exact")`` is two collectives::

    all_gather   (mass_k, N_k, min_leaf_k, seed, ...)  every rank knows the global picture
                                                       and derives every rank's shard counts
    all_to_all   records (bytes)                       owners send the windows they drew
                 (ranks on one host: owners write them into shared memory, a one-number
                 all_gather says so, and requesters copy their rows out)

``mode="local"`` needs only the first: each rank draws its batch from its own shard,
and each weight carries the shard factor ``K * mass_k / sum(mass)``, so the
DDP-averaged gradient has the same expectation as in exact mode.

``update_priorities`` applies this shard's keys at once and routes the others in two
all_to_alls (counts, then records).

``prefetch=k`` draws ``k`` batches per exchange and queues priority updates for other
shards until the next exchange, so a learner step costs 1/k of the collectives:
``update_priorities`` is then local, and only every k-th ``sample`` is collective.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from shardreplay.buffer.batch import Batch
from shardreplay.buffer.checks import (
    as_index_array,
    as_priority_array,
    check_priorities,
    foreign_key,
    not_prioritized,
)
from shardreplay.buffer.device import pinned
from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.buffer.transitions import Transitions, transitions_from_batch
from shardreplay.distributed import global_sampling as gs
from shardreplay.distributed.drawn import Drawn, drawn_weights, padding, split_batches
from shardreplay.distributed.exact_exchange import ExactExchange
from shardreplay.distributed.exchange import RecordLayout
from shardreplay.distributed.group import Collectives
from shardreplay.distributed.kernels import BAD_KEY, BAD_PRIORITY, split_updates
from shardreplay.distributed.pending import PendingUpdates
from shardreplay.errors import ConfigError, EmptyBufferError, InvalidKeyError, ShardReplayError
from shardreplay.spec.keys import MAX_SHARDS, with_shard

SAMPLE_MODES = ("exact", "local")
# Named in a timeout's message: a lone rank asking len() must learn why it waits.
_SIZES_OP = ("ShardedReplayBuffer.global_sizes (len(), num_steps and capacity are collectives: every "
             "rank must call them at the same point; len(buffer.local) is this rank's shard alone)")
# Columns of the stats row each rank contributes to a sampling exchange (the last K
# columns count its queued priority updates per owner shard).
_MASS, _COUNT, _LOW, _MODE, _BATCH, _SEED, _PREFETCH, _HOST, _NONCE, _MAXP, _TAG, _FOREIGN = range(12)


class ShardedReplayBuffer:
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

    Raises:
        ConfigError: torch.distributed not initialised, a fifo shard, too many ranks,
            prefetch < 1.
    """

    def __init__(self, local_buffer: ReplayBuffer, group: Any = None, *, timeout_s: float = 60.0,
                 device: torch.device | str | None = None, seed: int | None = None,
                 prefetch: int = 1, shared_memory: bool = True) -> None:
        if not isinstance(local_buffer, ReplayBuffer):
            raise ConfigError("local_buffer must be a shardreplay.ReplayBuffer")
        if local_buffer.sampler_name == "fifo":
            raise ConfigError("a sharded buffer samples uniform or prioritized shards, not fifo")
        if not isinstance(prefetch, int | np.integer) or prefetch < 1:
            raise ConfigError(f"prefetch must be a positive integer, got {prefetch!r}")
        self.local = local_buffer
        self._comm = Collectives(group, timeout_s)
        if self._comm.world_size > MAX_SHARDS:
            raise ConfigError(f"at most {MAX_SHARDS} shards are supported")
        self.rank = self._comm.rank
        self.world_size = self._comm.world_size
        self.device = torch.device(device) if device is not None else self._comm.device
        seed = local_buffer.seed if seed is None else seed
        self._rng = np.random.default_rng(None if seed is None else [seed, self.rank, 0x5EED])
        self._layout = RecordLayout(local_buffer.spec, local_buffer.window)
        self.invalid_keys = 0
        # Every shard's key tag (0: not known yet), learnt at each exchange and checkpoint
        # load, so keys that are no keys of this buffer are refused where they are passed.
        self._tags = np.zeros(self.world_size, np.int64)
        self.updates_applied = 0  # priorities applied to this shard, from any rank, so far
        self.prefetch = int(prefetch)
        self._ready: deque[Drawn] = deque()
        self._ready_for: tuple[int, str] | None = None
        self._pending = PendingUpdates(self.world_size)
        self._routed_max = 0.0  # the largest priority this rank sent to other shards
        # Exact-mode refills; shared memory is only offered on CPU (gloo) groups.
        self._exact = ExactExchange(local_buffer, self._comm, self._layout,
                                    shared_memory and self._comm.device.type == "cpu")

    @property
    def collectives(self) -> Collectives:
        """The group's collectives (used by checkpoint loading to agree across ranks)."""
        return self._comm

    # -- writes stay local ----------------------------------------------------------------
    def add(self, step: Any, stream_ids: Any = None, priorities: Any = None) -> None:
        """Write one step per stream into this rank's shard (see ReplayBuffer.add)."""
        self.local.add(step, stream_ids, priorities)

    def extend(self, chunk: Any, stream_ids: Any = None, priorities: Any = None) -> None:
        """Write ``T`` steps per stream into this rank's shard (see ReplayBuffer.extend)."""
        self.local.extend(chunk, stream_ids, priorities)

    # -- global sizes (collective) ----------------------------------------------------------
    def global_sizes(self) -> tuple[int, int, int]:
        """``(len, num_steps, capacity)`` summed over all shards (one collective)."""
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
    def sample(self, batch_size: int, mode: str = "exact") -> Batch:
        """Draw ``batch_size`` windows for this rank from the global distribution.

        With ``prefetch=k`` one exchange draws ``k`` batches, and the next ``k - 1`` calls
        are served from them without any collective (they must ask for the same
        ``batch_size`` and ``mode``).

        Raises:
            ConfigError: bad batch size or mode (raised before any collective); the ranks
                passed different modes or prefetch depths (raised on every rank alike,
                after the first collective, so the ranks stay in step); a call that
                differs from the prefetched batches' size or mode.
            EmptyBufferError: no shard has a window to draw (on every rank alike).
            CollectiveTimeout: a peer rank did not join in time.
        """
        if not isinstance(batch_size, int | np.integer) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
        if mode not in SAMPLE_MODES:
            raise ConfigError(f"mode must be one of {SAMPLE_MODES}, got {mode!r}")
        if not self._ready:
            self._refill(int(batch_size), mode)
        elif self._ready_for != (int(batch_size), mode):
            raise ConfigError(
                f"{len(self._ready)} prefetched batches of {self._ready_for} are waiting; with "
                f"prefetch={self.prefetch} every sample() call must ask for the same batch_size "
                f"and mode until they are used (got {(int(batch_size), mode)})")
        return self._serve(self._ready.popleft())

    def sample_transitions(self, batch_size: int, gamma: float, n: int | None = None,
                           mode: str = "exact", **names: str) -> Transitions:
        """:meth:`sample` (collective, same arguments) as n-step transitions, as
        :meth:`ReplayBuffer.sample_transitions` returns them (``bootstrap_discount`` holds
        gamma already).

        Raises:
            ConfigError, EmptyBufferError, CollectiveTimeout: as :meth:`sample`; a bad
                ``gamma`` or ``n`` (after the collective, on every rank alike).
        """
        return transitions_from_batch(self.sample(batch_size, mode), gamma, n, **names)

    def sharding_state(self) -> dict[str, Any]:
        """This rank's own state beside its shard, JSON-ready: the shard-choice RNG and
        the largest priority it routed to other shards (saved with a checkpoint part)."""
        return {"rng": self._rng.bit_generator.state, "routed_max": self._routed_max}

    def load_sharding_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`sharding_state` returned (a checkpoint load does this).

        Raises:
            ConfigError: ``state`` is not from :meth:`sharding_state` (nothing changes).
        """
        try:
            scratch = type(self._rng.bit_generator)()
            scratch.state = dict(state["rng"])
            routed = float(state.get("routed_max", 0.0))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError("not a sharding state from ShardedReplayBuffer.sharding_state(): "
                              f"{exc!r}") from exc
        self._rng.bit_generator.state = scratch.state
        self._routed_max = routed if math.isfinite(routed) else 0.0

    @property
    def prefetched(self) -> int:
        """Batches drawn by the last exchange and not yet returned by :meth:`sample`."""
        return len(self._ready)

    def discard_prefetched(self) -> None:
        """Drop the prefetched batches and the queued updates (no collective): what they
        name is gone once the shard's content is replaced, e.g. by a checkpoint load."""
        self._ready.clear()
        self._ready_for = None
        self._pending.take()

    @property
    def pending_updates(self) -> int:
        """Priority updates for other shards queued here (``prefetch > 1``) until the next
        exchange."""
        return len(self._pending)

    def _refill(self, n: int, mode: str) -> None:
        """One exchange: route queued updates, agree on the global picture, draw
        ``prefetch`` batches (exact: fetch them from their owners).

        In local mode this shard's draw needs nothing from the other ranks, so it runs
        while the stats are in flight (unless queued updates must land first)."""
        own: list[Any] = []
        early = None
        if mode == "local" and not len(self._pending):
            def early() -> None:
                own.append(self._draw_own(n * self.prefetch))
        stats = self._gather_stats(mode, n, early)
        _check_same_mode(stats[:, _MODE])
        _check_same_prefetch(stats[:, _PREFETCH])
        self.learn_key_tags(stats[:, _TAG])
        foreign = stats[:, _FOREIGN:].astype(np.int64)
        if foreign.any():  # queued priority updates first, so the draw sees them
            self._route(self._pending.take()[0], foreign)
            stats, own = self._gather_stats(mode, n), []
        self.local.raise_max_priority(float(stats[:, _MAXP].max()))
        masses, counts, min_leaf = stats[:, _MASS], stats[:, _COUNT], stats[:, _LOW]
        if counts.sum() == 0 or masses.sum() <= 0:
            raise EmptyBufferError("no shard has a window to sample: write more steps first")
        total, low = float(masses.sum()), float(min_leaf.min())
        if mode == "local":
            drawn = self._draw_local(n, masses, total, low, own[0] if own else None)
        else:
            drawn = self._exact.draw(masses, stats[:, _BATCH].astype(np.int64), int(stats[0, _SEED]),
                                     stats[:, _HOST], stats[:, _NONCE], self.prefetch, total, low)
        self._ready.extend(drawn)
        self._ready_for = (n, mode)

    def _gather_stats(self, mode: str, batch_size: int,
                      while_waiting: Callable[[], None] | None = None) -> np.ndarray:
        """One row per rank: mass, samplable count, min leaf, mode, batch size, a seed
        proposal (rank 0's is shared: see ``ExactExchange.draw``), prefetch depth, the
        largest priority seen here, and the count of queued updates for each owner."""
        mass, count, low, _beta = self.local.sampling_stats()
        seed = float(self._rng.integers(0, 1 << 52))  # exact in a float64
        mine = torch.tensor([mass, count, low if count else np.inf, SAMPLE_MODES.index(mode),
                             batch_size, seed, self.prefetch, self._exact.host_key,
                             self._exact.nonce, self._max_seen(), self.local.key_tag,
                             *self._pending.counts.tolist()],
                            dtype=torch.float64)
        return self._comm.all_gather(mine, "ShardedReplayBuffer.sample(all_gather stats)",
                                     while_waiting=while_waiting).cpu().numpy()

    def _draw_own(self, m: int) -> tuple[Any, ...] | None:
        """``m`` windows of this shard: (draw, data, mask, keys), or None when it is empty."""
        mass, count, _low, _beta = self.local.sampling_stats()
        if count == 0 or mass <= 0:
            return None
        draw = self.local.draw(m, advance_schedule=False)
        return (draw, *self.local.gather(draw.starts))

    def _draw_local(self, n: int, masses: np.ndarray, total: float, low: float,
                    own: tuple[Any, ...] | None) -> list[Drawn]:
        mass_k, k = masses[self.rank], self.prefetch
        if mass_k <= 0:
            return [padding(self._layout, self.local.window, n) for _ in range(k)]
        draw, data, mask, keys = own if own is not None else self._draw_own(k * n)
        prob = gs.global_probabilities(draw.probabilities, mass_k, total)
        tensors = {name: torch.from_numpy(v) for name, v in data.items()}
        return split_batches(tensors, torch.from_numpy(mask), torch.from_numpy(with_shard(keys, self.rank)),
                             torch.from_numpy(prob), n, total, low, self.world_size * mass_k / total,
                             self.local.current_beta())

    def _serve(self, d: Drawn) -> Batch:
        """A prefetched draw as a Batch, weighted with beta at this call (the schedule
        advances once per sample() call, prefetched or not)."""
        beta = self.local.current_beta()
        self.local.advance_schedule()
        weights = d.weights if beta == d.beta else drawn_weights(d.prob, d.total, d.low, beta, d.factor)
        batch = Batch(data=d.data, mask=d.mask, keys=d.keys, weights=weights, probabilities=d.prob)
        if batch.keys.device == self.device:
            return batch
        if self.device.type == "cuda" and batch.keys.device.type == "cpu":
            return pinned(batch).to(self.device, non_blocking=True)
        return batch.to(self.device)

    # -- priorities ------------------------------------------------------------------------------
    def update_priorities(self, keys: Any, priorities: Any) -> int:
        """Route each priority to the shard that owns its key.

        With ``prefetch=1`` this is collective (every rank calls it, in the same order) and
        every update has landed on its owner when it returns. With ``prefetch > 1`` it is
        local: updates for this rank's shard are applied at once, the others are queued
        and routed at the next exchange (the next :meth:`sample` that refills, or
        :meth:`flush_updates`), before anything is drawn.

        Keys of -1 (padding from an empty shard in local mode) are skipped. Stale keys
        are ignored and counted on the owner (``local.stale_updates``).

        Returns:
            The number of updates this rank's shard applied in this call (from any rank
            with ``prefetch=1``; its own with ``prefetch > 1``).

        Raises:
            ConfigError: the shards are not prioritized (priorities would change nothing).
            InvalidPriorityError / InvalidKeyError: this rank's input was bad (keys must
                be this buffer's: see ``spec/keys.py``); it still
                joined the exchange (with nothing to send) so no peer hangs, and nothing
                of its input was applied or queued.
            CollectiveTimeout: a peer rank did not join in time.
        """
        error: ShardReplayError | None = None
        try:
            own_keys, own_prios, foreign_keys, foreign_prios = self._split_updates(keys, priorities)
        except ShardReplayError as exc:
            if self.prefetch > 1:
                raise
            error = exc
            own_keys = foreign_keys = np.empty(0, np.int64)
            own_prios = foreign_prios = np.empty(0, np.float32)
        if foreign_prios.size:
            self._routed_max = max(self._routed_max, float(foreign_prios.max()))
        applied = self._apply_own(own_keys, own_prios)
        if self.prefetch > 1:
            self._pending.add(foreign_keys, foreign_prios)
            return applied
        pending = PendingUpdates(self.world_size)
        pending.add(foreign_keys, foreign_prios)
        payload, send_counts = pending.take()
        applied += self._route(payload, self._exchange_counts(send_counts))
        if error is not None:
            raise error
        return applied

    def _exchange_counts(self, send_counts: np.ndarray) -> np.ndarray:
        """Tell every owner how many updates come from here, and every rank the largest
        priority seen here (so new steps everywhere get the global maximum at once);
        returns the ``[from, to]`` count matrix :meth:`_route` needs."""
        k = self.world_size
        mine = np.empty((k, 2), np.int64)
        mine[:, 0], mine[:, 1] = send_counts, np.float64(self._max_seen()).view(np.int64)
        got = self._comm.all_to_all(torch.from_numpy(mine.ravel()), [2] * k, [2] * k,
                                    "ShardedReplayBuffer.update_priorities(counts)").cpu().numpy()
        got = got.reshape(k, 2)
        self.local.raise_max_priority(float(got[:, 1].view(np.float64).max()))
        foreign = np.zeros((k, k), np.int64)
        foreign[self.rank], foreign[:, self.rank] = send_counts, got[:, 0]
        return foreign

    def _max_seen(self) -> float:
        """The largest priority this shard holds as its running maximum, or routed away."""
        return max(self.local.max_priority(), self._routed_max)

    def flush_updates(self) -> int:
        """Route the queued updates of ``prefetch > 1`` to their owners now (collective:
        every rank calls it at the same point, e.g. before a checkpoint).

        Returns:
            The number of updates this rank's shard applied.

        Raises:
            CollectiveTimeout: a peer rank did not join in time.
        """
        mine = torch.from_numpy(self._pending.counts.copy())
        foreign = self._comm.all_gather(mine, "ShardedReplayBuffer.flush_updates(counts)").cpu().numpy()
        return self._route(self._pending.take()[0], foreign) if foreign.any() else 0

    def _route(self, payload: np.ndarray, foreign: np.ndarray) -> int:
        """Send payload rows to their owners (``foreign[r, o]`` rows from rank r to owner
        o) and apply what arrives here."""
        got = self._comm.all_to_all(torch.from_numpy(payload), foreign[self.rank].tolist(),
                                    foreign[:, self.rank].tolist(),
                                    "ShardedReplayBuffer.update_priorities(records)").cpu().numpy()
        applied = self._apply_updates(got[:, 0], got[:, 1].view(np.float64).astype(np.float32))
        self.updates_applied += applied
        return applied

    def learn_key_tags(self, tags: Any) -> None:
        """Note every shard's key tag (from an exchange, or a checkpoint load's agreement)."""
        self._tags = np.asarray(tags).astype(np.int64)

    def _split_updates(self, keys: Any, priorities: Any) -> tuple[np.ndarray, ...]:
        """Checked ``(own keys with shard 0, own priorities, foreign keys, foreign
        priorities)``; padding keys (-1) dropped.

        Raises:
            ConfigError: the shards are not prioritized.
            InvalidKeyError / InvalidPriorityError: bad input (nothing was changed).
        """
        if self.local.sampler_name != "prioritized":
            raise ConfigError(not_prioritized(self.local.sampler_name))
        keys_np = np.ascontiguousarray(as_index_array(keys, "keys"))
        prios = np.ascontiguousarray(as_priority_array(priorities, keys_np.shape))
        self._tags[self.rank] = self.local.key_tag  # a checkpoint load may have changed it
        status, bad, own_k, own_p, for_k, for_p = split_updates(
            keys_np, prios, self.rank, self._tags, self.local.capacity)
        if status == BAD_PRIORITY:
            check_priorities(prios, keys_np.shape)  # raises with the precise reason
        if status == BAD_KEY:
            raise InvalidKeyError(foreign_key(keys_np, bad, "sharded buffer"))
        return own_k, own_p, for_k, for_p

    def _apply_own(self, keys: np.ndarray, prios: np.ndarray) -> int:
        applied = self.local.update_priorities(keys, prios) if keys.size else 0
        self.updates_applied += applied
        return applied

    def _apply_updates(self, keys: np.ndarray, prios: np.ndarray) -> int:
        """Apply routed updates; keys that fit no slot here are counted and skipped."""
        fits = self.local.fits_keys(keys)
        if not fits.all():
            self.invalid_keys += int((~fits).sum())
            keys, prios = keys[fits], prios[fits]
        return self.local.update_priorities(keys, prios) if keys.size else 0


def _check_same_prefetch(depths: np.ndarray) -> None:
    if (depths != depths[0]).any():
        raise ConfigError(f"ranks use different prefetch depths ({depths.astype(int).tolist()}); "
                          "every rank must construct its ShardedReplayBuffer with the same prefetch")


def _check_same_mode(codes: np.ndarray) -> None:
    """Every rank must sample in the same mode: exact ranks go on to exchange records
    while local ranks go on to their next call, and those collectives would pair up
    with each other's and swap unrelated bytes (seen: sample records read as priorities)."""
    if (codes != codes[0]).any():
        ranks = {m: [r for r, c in enumerate(codes) if c == i] for i, m in enumerate(SAMPLE_MODES)}
        raise ConfigError(f"ranks called sample() with different modes ({ranks}); every rank must "
                          "pass the same mode to the same call")
