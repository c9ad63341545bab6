"""Data-parallel learners kept in step: a checksum of a learner's tensors, and the check
that gloo ranks learning from different data end with the same networks.

Import as ``from tests.support.in_step import ...`` (torch is imported here, not by
``tests.support``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from tests.support.ranks import run_ranks


def checksum(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 of the tensors' bytes, in order (bitwise equal tensors: equal checksums)."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


def learn_on_own_data(agent: Any, buffer: Any, batch_size: int, updates: int,
                      checksum_of: Callable[[Any], str]) -> dict[str, Any]:
    """``updates`` learner steps of ``agent`` on batches of ``batch_size`` from ``buffer``
    (this rank's own data, as its own shard), the new priorities written back; returns
    ``start`` and ``end`` (``checksum_of(agent)`` before and after) and ``updates`` (the
    agent's count), as :func:`assert_ranks_in_step` takes them."""
    start = checksum_of(agent)
    for _ in range(updates):
        batch = buffer.sample(batch_size)
        priorities, _loss = agent.learn(batch)
        buffer.update_priorities(batch.keys, priorities)
    return {"start": start, "end": checksum_of(agent), "updates": agent.updates}


def assert_ranks_in_step(fn: Callable[..., dict[str, Any]], updates: int, world: int = 2,
                         timeout_s: float = 120.0) -> dict[str, Any]:
    """Run ``fn(rank, world, updates)`` on ``world`` gloo ranks and check they stayed in step.

    ``fn`` builds a learner from its own seed, takes ``updates`` updates on its own data
    (:func:`learn_on_own_data`) and returns ``start`` and ``end`` (checksums of the networks
    before and after), ``updates`` (its count) and any other value that must match over
    ranks (a temperature, ...).

    Returns:
        Rank 0's result.

    Raises:
        AssertionError: a rank's result differs from rank 0's (it did not start from rank 0's
            networks, or the ranks drifted apart), the networks did not move, or the count
            is not ``updates``.
    """
    results = run_ranks(fn, world, updates, timeout_s=timeout_s)
    first = results[0]
    for rank, result in enumerate(results[1:], start=1):
        assert result == first, f"rank {rank} is out of step with rank 0: {result} != {first}"
    assert first["end"] != first["start"] and first["updates"] == updates
    return first
