"""Typed records the ranks of a sharded buffer gather: settings once, stats per exchange.

Each record travels as one int64 tensor row (``to_tensor``); floats go as their IEEE bits,
so every value, 64-bit integers included, arrives exactly. ``from_tensor`` reads the
gathered rows of every rank back as columns.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from shardreplay.errors import ConfigError

_R = TypeVar("_R", bound="_Row")


@dataclass(frozen=True)
class _Row:
    """A record of scalar fields (``_FLOATS`` name the float64 ones, the others are int64)
    and an optional trailing int64 vector ``tail``."""

    _FLOATS: ClassVar[frozenset[str]] = frozenset()

    def to_tensor(self) -> torch.Tensor:
        """This record as one int64 row: scalars in field order, then ``tail``."""
        names = self._scalar_names()
        row = np.empty(len(names) + len(self._tail()), np.int64)
        for i, name in enumerate(names):
            value = getattr(self, name)
            row[i] = np.float64(value).view(np.int64) if name in self._FLOATS else int(value)
        row[len(names):] = self._tail()
        return torch.from_numpy(row)

    @classmethod
    def from_tensor(cls: type[_R], rows: torch.Tensor) -> _R:
        """The rows of every rank (``[K, n]`` from ``all_gather``, any device) as one record
        whose fields are ``[K]`` columns (``tail``: ``[K, m]``).

        Raises:
            ConfigError: ``rows`` is not two-dimensional.
        """
        if rows.ndim != 2:
            raise ConfigError(f"{cls.__name__}.from_tensor takes the gathered [ranks, n] rows")
        names = cls._scalar_names()
        table = rows.cpu().numpy().astype(np.int64, copy=False)
        cols: dict[str, Any] = {
            name: table[:, i].view(np.float64) if name in cls._FLOATS else table[:, i].copy()
            for i, name in enumerate(names)}
        if "tail" in {f.name for f in fields(cls)}:
            cols["tail"] = table[:, len(names):].copy()
        return cls(**cols)

    @classmethod
    def _scalar_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "tail"]

    def _tail(self) -> np.ndarray:
        return np.asarray(getattr(self, "tail", ()), np.int64).reshape(-1)


@dataclass(frozen=True)
class SamplingSettings(_Row):
    """What every rank tells the others once, at construction (:mod:`agreement` checks
    it): its spec fingerprint (int64 bits) and description length, its sampler (an index
    of ``("uniform", "prioritized")``), alpha and beta schedule (0 for uniform), window,
    sequence period,
    sampling mode (an index of ``SAMPLE_MODES``), prefetch depth and
    pipeline flag, and its host key and region nonce for the same-host exchange
    (:mod:`shared_records`), which may differ."""

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
