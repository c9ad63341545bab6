"""ShardedReplayBuffer: K local buffers on K ranks, sampled as one buffer.

Every rank of a ``torch.distributed`` group owns one shard (a :class:`ReplayBuffer`);
writes stay local. ``sample`` and ``update_priorities`` are collective: every rank
calls them in the same order, also when its own shard is empty (DESIGN.md rules 5-6).

One ``sample(B, mode="exact")`` is three collectives::

    all_gather   (mass_k, N_k, min_leaf_k)          every rank knows the global picture
    all_to_all   counts  c[r -> k]                 rank r wants c items from shard k
    all_to_all   records (bytes)                   owners send the windows they drew

``mode="local"`` needs only the first: each rank draws its batch from its own shard,
and each weight carries the shard factor ``K * mass_k / sum(mass)``, so the
DDP-averaged gradient has the same expectation as in exact mode.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shardreplay.buffer.batch import Batch
from shardreplay.buffer.checks import as_index_array, as_priority_array, check_priorities
from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.distributed import global_sampling as gs
from shardreplay.distributed.exchange import RecordLayout
from shardreplay.distributed.group import Collectives
from shardreplay.errors import ConfigError, EmptyBufferError, InvalidKeyError, ShardReplayError
from shardreplay.spec.fields import StepType
from shardreplay.spec.keys import MAX_SHARDS, key_shard, with_shard

SAMPLE_MODES = ("exact", "local")


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

    Raises:
        ConfigError: torch.distributed not initialised, a fifo shard, too many ranks.
    """

    def __init__(self, local_buffer: ReplayBuffer, group: Any = None, *, timeout_s: float = 60.0,
                 device: torch.device | str | None = None, seed: int | None = None) -> None:
        if not isinstance(local_buffer, ReplayBuffer):
            raise ConfigError("local_buffer must be a shardreplay.ReplayBuffer")
        if local_buffer.sampler_name == "fifo":
            raise ConfigError("a sharded buffer samples uniform or prioritized shards, not fifo")
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
        total = self._comm.all_reduce_sum(local, "ShardedReplayBuffer.global_sizes").cpu()
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

        Raises:
            ConfigError: bad batch size or mode (raised before any collective), or the
                ranks passed different modes (raised on every rank alike, after the
                first collective, so the ranks stay in step).
            EmptyBufferError: no shard has a window to draw (on every rank alike).
            CollectiveTimeout: a peer rank did not join in time.
        """
        if not isinstance(batch_size, int | np.integer) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
        if mode not in SAMPLE_MODES:
            raise ConfigError(f"mode must be one of {SAMPLE_MODES}, got {mode!r}")
        stats = self._gather_stats(mode, int(batch_size))
        _check_same_mode(stats[:, 4])
        masses, counts, min_leaf = stats[:, 0], stats[:, 1], stats[:, 2]
        if counts.sum() == 0 or masses.sum() <= 0:
            raise EmptyBufferError("no shard has a window to sample: write more steps first")
        beta = float(stats[self.rank, 3])
        self.local.advance_schedule()
        total, low = float(masses.sum()), float(min_leaf.min())
        if mode == "local":
            return self._sample_local(int(batch_size), masses, total, low, beta)
        return self._sample_exact(stats, total, low, beta)

    def _gather_stats(self, mode: str, batch_size: int) -> np.ndarray:
        """One row per rank: mass, samplable count, min leaf, beta, mode, batch size, and
        a seed proposal (rank 0's is shared: see :meth:`_sample_exact`)."""
        mass, count, low, beta = self.local.sampling_stats()
        seed = float(self._rng.integers(0, 1 << 52))  # exact in a float64
        mine = torch.tensor([mass, count, low if count else np.inf, beta, SAMPLE_MODES.index(mode),
                             batch_size, seed], dtype=torch.float64)
        return self._comm.all_gather(mine, "ShardedReplayBuffer.sample(all_gather stats)").cpu().numpy()

    def _sample_local(self, n: int, masses: np.ndarray, total: float, low: float,
                      beta: float) -> Batch:
        mass_k = masses[self.rank]
        if mass_k <= 0:
            return self._padding_batch(n)
        draw = self.local.draw(n, advance_schedule=False)
        data, mask, keys = self.local.gather(draw.starts)
        prob = gs.global_probabilities(draw.probabilities, mass_k, total)
        weights = gs.importance_weights(prob, low, total, beta)
        weights *= np.float32(self.world_size * mass_k / total)
        return self._batch({k: torch.from_numpy(v) for k, v in data.items()}, torch.from_numpy(mask),
                           torch.from_numpy(with_shard(keys, self.rank)),
                           torch.from_numpy(weights), torch.from_numpy(prob))

    def _sample_exact(self, stats: np.ndarray, total: float, low: float, beta: float) -> Batch:
        """Every rank draws every requester's shard counts from one shared seed (rank 0's
        proposal in the stats), so the counts need no exchange of their own: two
        collectives per sample. Each requester's counts are still Multinomial(mass/total)."""
        masses, n = stats[:, 0], int(stats[self.rank, 5])
        all_want = np.stack([gs.shard_counts(np.random.default_rng([int(stats[0, 6]), r]), masses,
                                             int(stats[r, 5])) for r in range(self.world_size)])
        want, asked = all_want[self.rank], all_want[:, self.rank]
        records = self._draw_records(int(asked.sum()))
        rb = self._layout.record_bytes
        recv = self._comm.all_to_all(torch.from_numpy(records).reshape(-1),
                                     (asked * rb).tolist(), (want * rb).tolist(),
                                     "ShardedReplayBuffer.sample(records)")
        parts = self._layout.unpack(recv.reshape(n, rb))
        # numpy, not torch.repeat_interleave: on a CPU with more ranks than cores that one
        # small op took 25-35 ms (intra-op threads), more than the whole exchange.
        owner_mass = torch.from_numpy(np.repeat(masses, want)).to(recv.device)
        prob = parts["probability"] * owner_mass / total
        weights = ((prob * total / low) ** -beta).to(torch.float32)
        data = {k[len("data."):]: v for k, v in parts.items() if k.startswith("data.")}
        return self._batch(data, parts["mask"], parts["key"], weights, prob)

    def _draw_records(self, n: int) -> np.ndarray:
        """Draw ``n`` windows from this shard for all requesters, as records (in rank order)."""
        if n == 0:
            return np.empty((0, self._layout.record_bytes), np.uint8)
        draw = self.local.draw(n, advance_schedule=False)
        data, mask, keys = self.local.gather(draw.starts)
        return self._layout.pack(data, mask, with_shard(keys, self.rank), draw.probabilities)

    def _padding_batch(self, n: int) -> Batch:
        """Zero-weight stand-in for an empty shard in local mode (keys -1 are skipped).

        Each window is a well-formed terminated episode of zeros (FIRST, then LAST with
        discount 0, mask True on those two positions), so the rank's training step
        (n-step targets, forward, backward) runs on it as on real data and takes part in
        the DDP gradient all-reduce; weight 0 makes its contribution nothing. An all-False
        mask would make ``nstep_transitions`` raise on this rank alone and leave the
        others waiting in the all-reduce.
        """
        window = self.local.window
        data = {}
        for name, dtype, shape, _o, _b in self._layout.parts:
            if name.startswith("data."):
                data[name[len("data."):]] = torch.zeros((n, *shape), dtype=_torch_dtype(dtype))
        data["step_type"][:, 1:] = int(StepType.LAST)
        data["discount"][:, 1:] = 0.0
        data["episode_id"][:] = -1
        mask = torch.zeros((n, window), dtype=torch.bool)
        mask[:, :2] = True
        return self._batch(data, mask, torch.full((n,), -1, dtype=torch.int64), torch.zeros(n),
                           torch.zeros(n, dtype=torch.float64))

    def _batch(self, data: dict[str, torch.Tensor], mask: torch.Tensor, keys: torch.Tensor,
               weights: torch.Tensor, prob: torch.Tensor) -> Batch:
        batch = Batch(data=data, mask=mask, keys=keys, weights=weights.to(torch.float32),
                      probabilities=prob.to(torch.float64))
        if batch.keys.device == self.device:
            return batch
        if self.device.type == "cuda" and batch.keys.device.type == "cpu":
            return _pinned(batch).to(self.device, non_blocking=True)
        return batch.to(self.device)

    # -- priorities (collective) ----------------------------------------------------------------
    def update_priorities(self, keys: Any, priorities: Any) -> int:
        """Route each priority to the shard that owns its key (collective).

        Keys of -1 (padding from an empty shard in local mode) are skipped. Stale keys
        are ignored and counted on the owner (``local.stale_updates``).

        Returns:
            The number of updates this rank's shard applied (from any rank).

        Raises:
            InvalidPriorityError / InvalidKeyError: this rank's input was bad; it still
                joined the exchange (with nothing to send) so no peer hangs, and nothing
                of its input was applied.
            CollectiveTimeout: a peer rank did not join in time.
        """
        error: ShardReplayError | None = None
        try:
            keys_np, prios = self._checked_updates(keys, priorities)
        except ShardReplayError as exc:
            error, keys_np, prios = exc, np.empty(0, np.int64), np.empty(0, np.float32)
        owner = key_shard(keys_np)
        order = np.argsort(owner, kind="stable")
        send_counts = np.bincount(owner, minlength=self.world_size).astype(np.int64)
        recv_counts = self._comm.all_to_all(torch.from_numpy(send_counts), [1] * self.world_size,
                                            [1] * self.world_size,
                                            "ShardedReplayBuffer.update_priorities(counts)")
        recv_counts = recv_counts.cpu().numpy()
        payload = np.stack([with_shard(keys_np[order], 0),
                            prios[order].astype(np.float64).view(np.int64)], axis=1)
        got = self._comm.all_to_all(torch.from_numpy(payload), send_counts.tolist(),
                                    recv_counts.tolist(),
                                    "ShardedReplayBuffer.update_priorities(records)").cpu().numpy()
        if error is not None:
            raise error
        return self._apply_updates(got[:, 0], got[:, 1].view(np.float64).astype(np.float32))

    def _checked_updates(self, keys: Any, priorities: Any) -> tuple[np.ndarray, np.ndarray]:
        keys_np = as_index_array(keys, "keys")
        prios = check_priorities(as_priority_array(priorities, keys_np.shape), keys_np.shape)
        keep = keys_np != -1
        keys_np, prios = keys_np[keep], prios[keep]
        owner = key_shard(keys_np)
        if keys_np.size and (keys_np.min() < 0 or owner.max() >= self.world_size):
            raise InvalidKeyError(f"keys must come from this sharded buffer's sample() "
                                  f"(owner shard outside 0..{self.world_size - 1})")
        return keys_np, prios

    def _apply_updates(self, keys: np.ndarray, prios: np.ndarray) -> int:
        """Apply routed updates; keys that fit no slot here are counted and skipped."""
        fits = self.local.fits_keys(keys)
        if not fits.all():
            self.invalid_keys += int((~fits).sum())
            keys, prios = keys[fits], prios[fits]
        return self.local.update_priorities(keys, prios) if keys.size else 0


def _check_same_mode(codes: np.ndarray) -> None:
    """Every rank must sample in the same mode: exact ranks go on to exchange records
    while local ranks go on to their next call, and those collectives would pair up
    with each other's and swap unrelated bytes (seen: sample records read as priorities)."""
    if (codes != codes[0]).any():
        ranks = {m: [r for r, c in enumerate(codes) if c == i] for i, m in enumerate(SAMPLE_MODES)}
        raise ConfigError(f"ranks called sample() with different modes ({ranks}); every rank must "
                          "pass the same mode to the same call")


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype)).dtype


def _pinned(batch: Batch) -> Batch:
    return Batch(data={k: v.pin_memory() for k, v in batch.data.items()},
                 mask=batch.mask.pin_memory(), keys=batch.keys.pin_memory(),
                 weights=batch.weights.pin_memory(), probabilities=batch.probabilities.pin_memory())
