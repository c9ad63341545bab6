"""The exchange strategy of ``mode="local"``: each rank draws its batches from its own
shard, and each weight carries the shard factor ``K * mass_k / sum(mass)``, so the
DDP-averaged gradient has the same expectation as in exact mode. No collective of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardreplay.buffer.shard import Shard
from shardreplay.distributed.exchange import Drawn, ExchangeStats, split_batches
from shardreplay.distributed.group import Released
from shardreplay.spec.fields import StepType
from shardreplay.spec.keys import with_shard
from shardreplay.spec.layout import RecordLayout
from shardreplay.spec.torch_dtypes import torch_dtype
from shardreplay.spec.windows import DATA


class LocalExchange:
    """Draws a rank's prefetched batches from its own shard.

    Args:
        local: this rank's shard.
        layout: the record layout of the shard's windows (for padding batches).
        window: the shard's window length.
        rank, world_size: this rank and the number of shards.
    """

    def __init__(self, local: Shard, layout: RecordLayout, window: int, rank: int,
                 world_size: int) -> None:
        self.local = local
        self._layout, self._window = layout, window
        self.rank, self.world_size = rank, world_size

    def start(self, n: int, k: int) -> Callable[[], Any] | None:
        """This shard's ``k * n`` windows, to draw while the stats are in flight (they
        need nothing from the other ranks); what it returns goes to :meth:`draw`."""
        return lambda: self._draw_own(n * k)

    def draw(self, stats: ExchangeStats, n: int, k: int, early: Any = None,
             released: Released | None = None) -> list[Drawn]:
        """``k`` batches of ``n`` windows of this shard (zero-weight padding when it is
        empty), weighted with the shard factor; ``early``: what :meth:`start` drew. No
        collective (``released`` is unused)."""
        masses = stats.mass
        total, low = float(masses.sum()), float(stats.min_leaf.min())
        mass_k = masses[self.rank]
        if mass_k <= 0:
            return [padding(self._layout, self._window, n) for _ in range(k)]
        draw, data, mask, keys = early if early is not None else self._draw_windows(k * n)
        prob = draw.probabilities * mass_k / total  # P(i) = q * mass_k / sum(mass)
        tensors = {name: torch.from_numpy(v) for name, v in data.items()}
        return split_batches(tensors, torch.from_numpy(mask), torch.from_numpy(with_shard(keys, self.rank)),
                             torch.from_numpy(prob), n, total, low, self.world_size * mass_k / total,
                             self.local.current_beta())

    def _draw_own(self, m: int) -> tuple[Any, ...] | None:
        """``m`` windows of this shard (as :meth:`_draw_windows`), or None when it is empty."""
        st = self.local.stats()
        if st.samplable == 0 or st.mass <= 0:
            return None
        return self._draw_windows(m)

    def _draw_windows(self, m: int) -> tuple[Any, ...]:
        """``m`` windows of this shard, which has some: (draw, data, mask, keys)."""
        draw = self.local.draw(m, advance_schedule=False)
        return (draw, *self.local.gather(draw.starts))


def padding(layout: RecordLayout, window: int, n: int) -> Drawn:
    """Zero-weight stand-in for an empty shard in local mode (keys -1 are skipped).

    Each window is a well-formed terminated episode of zeros (FIRST, then LAST with
    discount 0, mask True on those two positions), so the rank's training step (n-step
    targets, forward, backward) runs on it as on real data and takes part in the DDP
    gradient all-reduce; weight 0 makes its contribution nothing. An all-False mask would
    make ``nstep_transitions`` raise on this rank alone and leave the others waiting in
    the all-reduce.
    """
    data = {p.name[len(DATA):]: torch.zeros((n, *p.shape), dtype=torch_dtype(p.dtype))
            for p in layout.parts if p.name.startswith(DATA)}
    data["step_type"][:, 1:] = int(StepType.LAST)
    data["discount"][:, 1:] = 0.0
    data["episode_id"][:] = -1
    mask = torch.zeros((n, window), dtype=torch.bool)
    mask[:, :2] = True
    return split_batches(data, mask, torch.full((n,), -1, dtype=torch.int64),
                         torch.zeros(n, dtype=torch.float64), n, 1.0, 1.0, 0.0, 0.0)[0]
