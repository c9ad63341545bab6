"""What ``sample`` and ``info`` return: :class:`Batch`, :class:`BufferInfo`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Batch:
    """A sampled batch of ``B`` windows of length ``L``.

    Attributes:
        data: every user field (dotted names) plus ``step_type`` (uint8), ``discount``
            (float32) and ``episode_id`` (int64), each a tensor ``[B, L, *field_shape]``.
            Positions after the window's LAST step are padding (a copy of the LAST step).
        mask: bool ``[B, L]``, False on padding positions after a LAST.
        keys: int64 ``[B]``, names each window for :meth:`update_priorities`.
        weights: float32 ``[B]`` importance weights (``(N P(i))^-beta / max_j w_j``;
            all ones for uniform and fifo sampling).
        probabilities: float64 ``[B]``, the probability with which each window was drawn.
    """

    data: dict[str, torch.Tensor]
    mask: torch.Tensor
    keys: torch.Tensor
    weights: torch.Tensor
    probabilities: torch.Tensor

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy with every tensor on ``device``."""
        return self.apply(lambda t: t.to(device, non_blocking=non_blocking))

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """A batch of ``fn`` of every tensor (``pin_memory``, a move)."""
        return Batch({k: fn(v) for k, v in self.data.items()}, fn(self.mask), fn(self.keys),
                     fn(self.weights), fn(self.probabilities))


@dataclass(frozen=True)
class BufferInfo:
    """Sizes and counters of one buffer, or of this rank's shard of a sharded buffer (each
    field: docs/semantics.md, "Counters and inspecting a buffer")."""

    sampler: str
    num_steps: int
    samplable: int
    capacity: int
    stale_updates: int
    updates_applied: int
    invalid_keys: int
    max_priority: float
    key_tag: int
