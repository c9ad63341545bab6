"""Sequence batches for recurrent learners (R2D2, Kapturowski et al. 2019; docs/semantics.md,
"Sequence windows"): the actor's recurrent state at each window's first step
(:func:`sample_sequences`), ``burn_in`` steps unrolled without loss (``learn_mask``), and
the sequence priority ``eta * max |delta| + (1 - eta) * mean |delta|``
(:func:`sequence_priorities`). Works with any buffer whose ``sample`` returns a
:class:`Batch`, so the draw is the buffer's (exact over the shards of a sharded one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from shardreplay.buffer.batch import Batch
from shardreplay.errors import ConfigError, SpecMismatchError

__all__ = ["SequenceBatch", "learn_mask", "sample_sequences", "sequence_batch", "sequence_priorities"]

ETA = 0.9  # R2D2's mix of the max and the mean absolute TD error


class SamplesBatches(Protocol):
    """A buffer that draws windows: ``ReplayBuffer`` or ``ShardedReplayBuffer``."""

    window: int

    def sample(self, batch_size: int) -> Batch:
        """Draw ``batch_size`` windows."""


@dataclass(frozen=True)
class SequenceBatch:
    """``B`` sequences of ``L`` steps for a recurrent learner.

    Attributes:
        batch: the sampled windows (data ``[B, L, ...]``, mask, keys, weights).
        start_state: each named state field at the window's first step ``[B, ...]``:
            what the actor's recurrent network held there.
        burn_in: the first steps of every window that the learner unrolls without loss.
        learn_mask: bool ``[B, L]``: positions that enter the loss (not burn-in, not
            padding after the episode's end).
    """

    batch: Batch
    start_state: dict[str, torch.Tensor]
    burn_in: int
    learn_mask: torch.Tensor

    @property
    def keys(self) -> torch.Tensor:
        """The windows' keys, for ``update_priorities``."""
        return self.batch.keys

    @property
    def weights(self) -> torch.Tensor:
        """The windows' importance weights ``[B]``."""
        return self.batch.weights


def learn_mask(mask: torch.Tensor, burn_in: int) -> torch.Tensor:
    """``mask`` ``[B, L]`` with its first ``burn_in`` positions set False.

    Raises:
        ConfigError: ``burn_in`` is negative or leaves no step to learn from.
    """
    length = int(mask.shape[-1])
    if not isinstance(burn_in, int) or isinstance(burn_in, bool) or not 0 <= burn_in < length:
        raise ConfigError(f"burn_in must be an integer in [0, window={length}), got {burn_in!r}")
    out = mask.clone()
    out[..., :burn_in] = False
    return out


def sample_sequences(buffer: SamplesBatches, batch_size: int, *, burn_in: int,
                     state: Sequence[str] = ()) -> SequenceBatch:
    """Draw ``batch_size`` sequences from ``buffer`` (made with ``window=L``, and
    ``period=P`` for R2D2's overlap; a collective on a sharded buffer), with the ``state``
    fields at each window's first step and ``burn_in`` steps not learned from
    (docs/semantics.md, "Sequence windows").

    Raises:
        ConfigError: ``burn_in`` outside ``[0, L)``, or the buffer's errors.
        SpecMismatchError: a state field is not in the buffer's spec.
        EmptyBufferError: no sequence can be drawn yet.
    """
    learn_mask(torch.ones(1, buffer.window, dtype=torch.bool), burn_in)  # checks burn_in first
    return sequence_batch(buffer.sample(batch_size), burn_in=burn_in, state=state)


def sequence_batch(batch: Batch, *, burn_in: int, state: Sequence[str] = ()) -> SequenceBatch:
    """``batch`` (windows a buffer drew) as a :class:`SequenceBatch`: what
    :func:`sample_sequences` returns, for a learner handed the batch (``train``'s).

    Raises:
        ConfigError: ``burn_in`` outside ``[0, L)``.
        SpecMismatchError: a state field is not in the batch.
    """
    missing = [name for name in state if name not in batch.data]
    if missing:
        raise SpecMismatchError(f"state fields {missing} are not in the buffer's spec; name the fields "
                                f"the actor writes its recurrent state to (spec has {sorted(batch.data)})")
    return SequenceBatch(batch=batch, start_state={name: batch.data[name][:, 0] for name in state},
                         burn_in=burn_in, learn_mask=learn_mask(batch.mask, burn_in))


def sequence_priorities(td_errors: torch.Tensor, mask: torch.Tensor, eta: float = ETA) -> torch.Tensor:
    """R2D2's sequence priority ``eta * max |delta| + (1 - eta) * mean |delta|`` of each row
    of ``td_errors`` ``[B, T]`` over the positions of bool ``mask`` ``[B, T]`` (pass
    ``SequenceBatch.learn_mask`` cut to the positions ``td_errors`` covers): float32 ``[B]``,
    finite and >= 0, 0 for a row with no position in ``mask``.

    Raises:
        ConfigError: shapes differ, ``eta`` outside [0, 1], or a TD error is NaN or inf.
    """
    if td_errors.shape != mask.shape or td_errors.dim() != 2:
        raise ConfigError(f"td_errors and mask must both be [B, T]; got {tuple(td_errors.shape)} "
                          f"and {tuple(mask.shape)}")
    if not 0.0 <= float(eta) <= 1.0:
        raise ConfigError(f"eta must lie in [0, 1], got {eta!r}")
    delta = td_errors.detach().abs().to(torch.float64)
    if not torch.isfinite(delta).all():
        raise ConfigError("td_errors hold NaN or inf: a diverging loss; fix the learner before "
                          "updating priorities")
    m = mask.to(torch.bool)
    count = m.sum(dim=1)
    masked = torch.where(m, delta, torch.zeros_like(delta))
    mean = masked.sum(dim=1) / count.clamp(min=1)
    peak = masked.max(dim=1).values
    return (eta * peak + (1.0 - eta) * mean).to(torch.float32)
