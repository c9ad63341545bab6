"""Batches drawn by one exchange, waiting to be served by ``sample()`` calls.

A refill draws ``k * n`` windows at once; they are cut into ``k`` batches (views, no
copies) and weighted in one vectorised pass for the beta of the moment; a batch served at
another beta (a schedule moved on) is reweighted then.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardreplay.spec.fields import StepType
from shardreplay.spec.layout import RecordLayout
from shardreplay.spec.torch_dtypes import torch_dtype
from shardreplay.spec.windows import DATA


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


def drawn_weights(prob: torch.Tensor, total: float, low: float, beta: float,
                  factor: float) -> torch.Tensor:
    """``(P / P_min)^-beta * factor`` with ``P_min = low / total`` (float32; 0 for padding)."""
    if factor == 0.0:
        return torch.zeros(prob.shape, dtype=torch.float32, device=prob.device)
    return ((prob * (total / low)) ** -beta * factor).to(torch.float32)


def split_batches(data: dict[str, torch.Tensor], mask: torch.Tensor, keys: torch.Tensor,
                  prob: torch.Tensor, n: int, total: float, low: float, factor: float,
                  beta: float, records: torch.Tensor | None = None) -> list[Drawn]:
    """``k * n`` drawn windows as ``k`` batches of ``n`` (views, no copies), weighted for
    ``beta`` in one vectorised pass; ``records``: the records the views read, if any."""
    w = drawn_weights(prob, total, low, beta, factor)
    k = keys.shape[0] // n

    def batches(v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # One C++ call per array (views), not a Python slice per batch and array.
        return v.view(k, n, *v.shape[1:]).unbind(0)

    columns = {name: batches(v) for name, v in data.items()}
    blocks = batches(records) if records is not None else (None,) * k
    rest = zip(batches(mask), batches(keys), batches(prob), batches(w), blocks, strict=True)
    return [Drawn({name: parts[j] for name, parts in columns.items()}, m, key, p, weight, beta,
                  total, low, factor, block)
            for j, (m, key, p, weight, block) in enumerate(rest)]


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

