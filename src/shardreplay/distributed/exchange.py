"""One exchange of a :class:`ShardedReplayBuffer` (:class:`Refill`): route the queued
priority updates, agree on the global picture, and draw ``prefetch`` batches with the
mode's strategy (:class:`~.exact_exchange.ExactExchange`, :class:`LocalExchange`).

The ranks gather typed records (:class:`SamplingSettings` once, :class:`ExchangeStats` per
exchange), each as one int64 row (floats as their IEEE bits, so every value arrives
exactly). From every rank's ``(mass_k, N_k, min_leaf_k)`` an item drawn from shard ``k``
with local probability ``q`` has (docs/semantics.md, sampling rule 5)::

    P(i)  = q * mass_k / sum(mass)                    (global probability)
    w_i   = (P(i) / P_min)^-beta,  P_min = min_k(min_leaf_k) / sum(mass)
    local mode:  w_i *= K * mass_k / sum(mass)        (shard factor)
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np
import torch

from shardreplay.buffer.shard import Shard
from shardreplay.distributed.group import Collectives, Released
from shardreplay.distributed.priorities import STATS_OPS, PendingUpdates, PriorityRouter
from shardreplay.errors import ConfigError, EmptyBufferError
from shardreplay.spec.fields import StepType
from shardreplay.spec.keys import with_shard
from shardreplay.spec.layout import DATA, RecordLayout

_R = TypeVar("_R", bound="_Row")


@dataclass(frozen=True)
class _Row:
    """A record of scalar fields (``_FLOATS`` name the float64 ones, the others are int64)
    and an optional trailing int64 vector ``tail``."""

    _FLOATS: ClassVar[frozenset[str]] = frozenset()

    def to_row(self) -> np.ndarray:
        """This record as one int64 row: scalars in field order, then ``tail``."""
        values, dtype = self._layout()
        row = np.array(values(self), dtype).reshape(1).view(np.int64)
        tail = np.asarray(getattr(self, "tail", ()), np.int64).reshape(-1)
        return np.concatenate([row, tail])

    @classmethod
    def from_rows(cls: type[_R], rows: np.ndarray) -> _R:
        """The rows of every rank (``[K, n]`` from ``all_gather``) as one record whose
        fields are ``[K]`` columns (``tail``: ``[K, m]``).

        Raises:
            ConfigError: ``rows`` is not two-dimensional.
        """
        if rows.ndim != 2:
            raise ConfigError(f"{cls.__name__}.from_rows takes the gathered [ranks, n] rows")
        _, dtype = cls._layout()
        names, table = dtype.names or (), rows.astype(np.int64, copy=False)
        head = table[:, :len(names)].copy().view(dtype)[:, 0]  # every scalar a field of one copy
        cols: dict[str, Any] = {name: head[name] for name in names}
        if "tail" in cls.__dataclass_fields__:
            cols["tail"] = table[:, len(names):].copy()
        return cls(**cols)

    @classmethod
    @functools.cache
    def _layout(cls) -> tuple[Callable[[Any], tuple[Any, ...]], np.dtype]:
        """The scalar fields' getter, and their dtype (float64 ``_FLOATS``, the others int64)."""
        names = [f.name for f in fields(cls) if f.name != "tail"]
        return operator.attrgetter(*names), np.dtype([(n, "f8" if n in cls._FLOATS else "i8") for n in names])


@dataclass(frozen=True)
class SamplingSettings(_Row):
    """What every rank tells the others once, at construction (:func:`agreement.settings_of`
    fills it, :func:`agreement.check_agreed` checks it; the host key and region nonce of
    the same-host exchange may differ)."""

    _FLOATS: ClassVar[frozenset[str]] = frozenset({"alpha", "beta_start", "beta_end"})

    spec_fp: Any
    spec_len: Any
    sampler: Any
    alpha: Any
    beta_start: Any
    beta_end: Any
    beta_steps: Any
    window: Any
    period: Any
    mode: Any
    prefetch: Any
    pipeline: Any
    host_key: Any
    nonce: Any


@dataclass(frozen=True)
class ExchangeStats(_Row):
    """One rank's part of a sampling exchange: its shard's mass, samplable windows and
    smallest leaf (inf when empty), the batch size it asks for, a seed proposal (rank 0's
    is shared: see ``ExactExchange.draw``), the largest priority seen here, its key tag,
    and in ``tail`` the count of its queued priority updates for each owner shard."""

    _FLOATS: ClassVar[frozenset[str]] = frozenset({"mass", "min_leaf", "max_priority"})

    mass: Any
    samplable: Any
    min_leaf: Any
    batch_size: Any
    seed: Any
    max_priority: Any
    key_tag: Any
    tail: Any = ()


@dataclass
class Drawn:
    """A drawn batch, weighted for ``beta`` (reweighted when served at another beta)."""

    data: dict[str, torch.Tensor]
    mask: torch.Tensor
    keys: torch.Tensor
    prob: torch.Tensor  # global P(i), float64
    weights: torch.Tensor  # float32, for beta
    beta: float
    total: float
    low: float
    factor: float  # 1 exact, K mass_k / total local, 0 padding
    # The batch's rows of the exact exchange's records (contiguous uint8 [n, record_bytes],
    # page-locked when batches go to a GPU): moved to the GPU as one block, not per field.
    records: torch.Tensor | None = None


def drawn_weights(prob: np.ndarray, total: float, low: float, beta: float, factor: float) -> torch.Tensor:
    """``(P / P_min)^-beta * factor`` with ``P_min = low / total`` (float32; 0 for padding)."""
    if factor == 0.0:
        return torch.zeros(prob.shape, dtype=torch.float32)
    return torch.from_numpy(((prob * (total / low)) ** -beta * factor).astype(np.float32))


def split_batches(data: dict[str, np.ndarray], mask: np.ndarray, keys: np.ndarray, prob: np.ndarray, n: int,
                  total: float, low: float, factor: float, beta: float,
                  records: torch.Tensor | None = None) -> list[Drawn]:
    """``k * n`` drawn windows (numpy, batch after batch) as ``k`` batches of ``n`` (tensors sharing
    their memory), weighted for ``beta``; ``records``: the records the arrays view, if any."""
    blocks = (None,) * (len(keys) // n) if records is None else records.view(-1, n, records.shape[1]).unbind()
    drawn, t = [], torch.from_numpy
    for b, block in enumerate(blocks):
        r = slice(b * n, (b + 1) * n)
        drawn.append(Drawn({name: t(v[r]) for name, v in data.items()}, t(mask[r]), t(keys[r]), t(prob[r]),
                           drawn_weights(prob[r], total, low, beta, factor), beta, total, low, factor, block))
    return drawn


class ExchangeStrategy(Protocol):
    """How a mode draws a rank's batches from the ranks' stats, agreed every ``agree_every``-th exchange."""

    agree_every: int

    def start(self, n: int, k: int) -> Callable[[], Any] | None:
        """Work to run while the stats are in flight (its result goes to ``draw``)."""

    def draw(self, stats: ExchangeStats, n: int, k: int, early: Any = None,
             released: Released | None = None) -> list[Drawn]:
        """``k`` batches of ``n`` windows for this rank (collective for exact mode; its
        collectives wait inside ``released()``)."""


class Refill:
    """Draws ``prefetch`` batches per call (collective on ``comm``, the exchange group)
    with the mode's ``strategy``; ``choice`` (the shard-choice RNG) gives one seed
    proposal per exchange (rank 0's is shared)."""

    def __init__(self, shard: Shard, comm: Collectives, router: PriorityRouter,
                 strategy: ExchangeStrategy, prefetch: int, choice: np.random.Generator) -> None:
        self._shard, self._comm = shard, comm
        self._router, self.strategy = router, strategy
        self.prefetch = prefetch
        self._choice = choice
        self.agreed: ExchangeStats | None = None  # the stats last agreed (None: agree next)
        self._since = 0  # exchanges since then

    def __call__(self, n: int, pending: PendingUpdates, released: Released | None = None) -> list[Drawn]:
        """One exchange (its collectives: see :mod:`sharded_buffer`): route ``pending`` (and the
        others' queued updates), agree on the global picture, draw ``prefetch`` batches of ``n``
        (between agreements: with the stats last agreed, ``pending`` queued again, no collective).

        Raises:
            EmptyBufferError: no shard has a window to draw (on every rank alike).
            CollectiveTimeout: a peer rank did not join in time.
        """
        k = self.prefetch
        if self.agreed is not None and self._since < self.strategy.agree_every:
            self._since += 1
            self._router.pending.restore(pending)
            return self.strategy.draw(self.agreed, n, k)
        early = self.strategy.start(n, k) if not len(pending) else None
        box: list[Any] = []
        run = None if early is None else lambda: box.append(early())
        rows, _ = self._router.send(self._stats(n).to_row(), pending, STATS_OPS, released, run)
        stats = ExchangeStats.from_rows(rows)  # its tail: the counts sent
        self._router.learn_key_tags(stats.key_tag)
        if stats.tail.any() and self.strategy.agree_every > 1:  # updates landed: the draw must see
            # them (exact mode's draw has every shard's new figures sent with its records)
            rows_again = self._comm.all_gather(self._stats(n).to_row(),
                                               "ShardedReplayBuffer.sample(stats again)", released=released)
            stats, box = ExchangeStats.from_rows(rows_again), []
        self._shard.raise_max_priority(float(stats.max_priority.max()))
        if stats.samplable.sum() == 0 or stats.mass.sum() <= 0:
            raise EmptyBufferError("no shard has a window to sample: write more steps first")
        self.agreed, self._since = stats, 1
        return self.strategy.draw(stats, n, k, box[0] if box else None, released)

    def _stats(self, batch_size: int) -> ExchangeStats:
        st = self._shard.stats()
        seed = int(self._choice.integers(0, 1 << 63))
        return ExchangeStats(st.mass, st.samplable, st.min_leaf, batch_size, seed, self._shard.max_priority,
                             st.key_tag)


class LocalExchange:
    """The exchange strategy of ``mode="local"``: each rank draws its batches from its own
    shard, each weight carrying the shard factor ``K * mass_k / sum(mass)`` (so the
    DDP-averaged gradient has the same expectation as in exact mode); agreed every 16th
    exchange only. ``layout`` and ``window`` shape the padding batches of an empty shard."""

    agree_every = 16

    def __init__(self, local: Shard, layout: RecordLayout, window: int, rank: int,
                 world_size: int) -> None:
        self.local = local
        self._layout, self._window = layout, window
        self.rank, self.world_size = rank, world_size

    def start(self, n: int, k: int) -> Callable[[], Any] | None:
        """This shard's ``k * n`` windows, drawn while the stats are in flight."""
        return lambda: self._draw_own(n * k)

    def draw(self, stats: ExchangeStats, n: int, k: int, early: Any = None,
             released: Released | None = None) -> list[Drawn]:
        """``k`` batches of ``n`` windows of this shard (zero-weight padding when it is empty),
        weighted with its figures now and the others' in ``stats``; ``early``: from :meth:`start`."""
        own, *drawn = early if early is not None else self._draw_own(k * n)
        if not drawn:
            return [padding(self._layout, self._window, n) for _ in range(k)]
        masses, lows = stats.mass.tolist(), stats.min_leaf.tolist()  # K floats: Python is quicker
        total = sum(masses[:self.rank] + masses[self.rank + 1:]) + own.mass
        low = min(lows[:self.rank] + lows[self.rank + 1:] + [own.min_leaf])
        draw, data, mask, keys = drawn
        prob = draw.probabilities * own.mass / total  # P(i) = q * mass_k / sum(mass)
        return split_batches(data, mask, with_shard(keys, self.rank), prob, n, total, low,
                             self.world_size * own.mass / total, self.local.current_beta())

    def _draw_own(self, m: int) -> tuple[Any, ...]:
        """This shard's stats, then (unless it is empty) ``m`` windows: draw, data, mask, keys."""
        st = self.local.stats()
        if st.samplable == 0 or st.mass <= 0:
            return (st,)
        draw = self.local.draw(m, advance_schedule=False)
        return (st, draw, *self.local.gather(draw.starts))


def padding(layout: RecordLayout, window: int, n: int) -> Drawn:
    """Zero-weight stand-in for an empty shard in local mode (keys -1 are skipped): each
    window a terminated episode of zeros (FIRST, then LAST with discount 0), so the rank's
    training step runs on it and joins the DDP all-reduce (an all-False mask would make
    ``nstep_transitions`` raise on this rank alone and leave the others waiting)."""
    data = {p.name[len(DATA):]: np.zeros((n, *p.shape), p.dtype) for p in layout.parts
            if p.name.startswith(DATA)}
    data["step_type"][:, 1:] = int(StepType.LAST)
    data["discount"][:, 1:] = 0.0
    data["episode_id"][:] = -1
    mask = np.zeros((n, window), np.bool_)
    mask[:, :2] = True
    return split_batches(data, mask, np.full(n, -1, np.int64), np.zeros(n), n, 1.0, 1.0, 0.0, 0.0)[0]
