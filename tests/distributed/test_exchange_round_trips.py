"""Collectives, messages and round trips per exchange at K = 4 and 8, on real gloo ranks
(K = 16 by hand: ``ROUND_TRIP_WORLDS=16``; 16 ranks take about 37 s of the suite's 2 cores).

Every ``torch.distributed`` collective the buffer's groups issue is counted by wrapping the
module's functions in each rank (so a collective issued outside ``Collectives`` counts too).
Messages and round trips follow from gloo's algorithms over TCP, where a send waits for the
receiver's "ready" (gloo/transport/tcp/pair.cc):

* ``all_to_all_single``: each rank sends to every peer at once (gloo/alltoall.cc,
  alltoallv.cc): K-1 messages, one round trip at any K;
* ``all_gather_into_tensor``: a ring (gloo/allgather.cc), 2 (K-1) messages in K-1 dependent
  steps, each waiting for the receiver's "ready" of its previous step: K-1 round trips;
* ``all_reduce``: a ring of 2 (K-1) steps: 2 (K-1) messages and round trips.

The round trips an exchange pays across hosts are then the sum over its collectives. They
must not grow with K: the ring all_gathers made a pipelined exact exchange (then 4
collectives) pay 2 (K-1) + 2, 16 at K = 8; it is 2 now (the queued updates travel with the
first statistics, the owners' new statistics with the records). ``local`` mode's
``update_priorities`` issues none (every key it samples is its own), and its ``sample`` one
every 16th call (the agreement; the first call's is not counted here,
``test_sharded_collectives.py`` counts the schedule).

Across emulated hosts (``SHARDREPLAY_HOST``; K = 4 as 2 hosts of 2, K = 6 as 3 hosts of 2,
K = 8 as 2 hosts of 4) the exchange group is hierarchical (``distributed/hierarchy.py``):
the same collectives per call, each one all_to_all of the hosts' leaders over gloo, so
H (H - 1) messages cross between hosts per collective (not K (K - 1)), one round trip.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

import shardreplay as sr
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.distributed.sharded_buffer import internals_of
from shardreplay.spec.keys import key_shard
from tests.support import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SPEC = sr.Spec({"obs": sr.Field((), np.float32)})
BATCH = 16
STEPS = 3  # counted learner steps per case (after two that warm the exchange up)

# name in torch.distributed -> (messages per rank, round trips) at world size k
ALGORITHMS: dict[str, Callable[[int], tuple[int, int]]] = {
    "all_to_all_single": lambda k: (k - 1, 1),
    "all_gather_into_tensor": lambda k: (2 * (k - 1), k - 1),
    "all_gather_single": lambda k: (2 * (k - 1), k - 1),
    "all_reduce": lambda k: (2 * (k - 1), 2 * (k - 1)),
}


def _shard(rank: int) -> sr.ReplayBuffer:
    local = sr.ReplayBuffer(SPEC, num_streams=2, stream_capacity=64, window=2,
                            sampler="prioritized", seed=rank)
    steps = 40
    chunk = {"obs": np.ones((2, steps), np.float32), "step_type": np.ones((2, steps), np.uint8),
             "discount": np.ones((2, steps), np.float32)}
    chunk["step_type"][:, 0] = 0  # FIRST
    local.extend(chunk, priorities=np.full((2, steps), 1.0, np.float32))
    return local


class Counter:
    """Every collective this process issues, with its group, by ``torch.distributed`` function
    (installed once per process)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        for name in ALGORITHMS:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, kwargs.get("group")))
            return fn(*args, **kwargs)
        return counted

    def during(self, buf: ShardedReplayBuffer, call: Callable[[], Any]) -> list[str]:
        """The collectives ``call`` issued on ``buf``'s groups (a pipelined exchange it
        started included)."""
        parts = internals_of(buf)
        hier = parts.exchange_group.hierarchy
        groups = (parts.collectives.group, parts.exchange_group.group,
                  *([hier.leaders.group] if hier is not None and hier.leaders is not None else []))
        buf.settle()
        first, issued = len(self.calls), parts.exchange_group.issued
        call()
        buf.settle()
        calls = [name for name, group in self.calls[first:] if any(group is g for g in groups)]
        return calls if hier is None else [*calls, *["collective"] * (parts.exchange_group.issued - issued)]


def _figures(calls: list[list[str]], k: int) -> dict[str, float]:
    """Per call (mean over the counted calls): collectives, messages per rank, round trips."""
    per = [[ALGORITHMS[name](k) for name in call] for call in calls]
    return {"collectives": sum(map(len, calls)) / len(calls),
            "messages": sum(m for call in per for m, _ in call) / len(calls),
            "round_trips": sum(r for call in per for _, r in call) / len(calls),
            "names": sorted({name for call in calls for name in call})}


def _case(rank: int, world: int, counter: Counter, mode: str, pipeline: bool,
          shared_memory: bool = False) -> dict[str, Any]:
    buf = ShardedReplayBuffer(_shard(rank), timeout_s=120, shared_memory=shared_memory, mode=mode,
                              pipeline=pipeline)
    rng = np.random.default_rng(rank)
    samples, updates, foreign = [], [], 0
    for step in range(STEPS + 2):
        batch: list[Any] = []
        sampled = counter.during(buf, lambda b=batch: b.append(buf.sample(BATCH)))
        keys = batch[0].keys
        foreign += int((key_shard(keys.numpy()) != rank).sum())
        prios = rng.uniform(0.2, 0.9, len(keys)).astype(np.float32)  # below the max: no new maximum
        updated = counter.during(buf, lambda k=keys, p=prios: buf.update_priorities(k, p))
        # Not counted: the first exchange routes nothing (pipelined, the first call runs two),
        # the first that routes updates has no slot for them yet (a second all_to_all).
        if step >= 2:
            samples.append(sampled)
            updates.append(updated)
    buf.close()
    if shared_memory:  # what each call issued: its collectives, and its gloo calls (a leader's)
        return {"sample": samples, "update": updates, "foreign": foreign}
    return {"sample": _figures(samples, world), "update": _figures(updates, world), "foreign": foreign}


def _cases(rank: int, world: int, hosts: list[int] | None = None) -> dict[str, Any]:
    counter = Counter()
    if hosts is not None:
        os.environ["SHARDREPLAY_HOST"] = f"emulated-{hosts[rank]}"
    return {"exact": _case(rank, world, counter, "exact", False, hosts is not None),
            "exact pipelined": _case(rank, world, counter, "exact", True, hosts is not None),
            "local": _case(rank, world, counter, "local", False, hosts is not None)}


# Per learner step: (collectives, round trips) of sample and of update_priorities. The
# pipelined exchange a sample starts carries the updates queued by the step before: stats
# with the updates to their owners, then the records with the owners' new stats. A strict
# update sends counts, maxima and updates in one all_to_all.
EXPECTED = {
    "exact": {"sample": (2, 2), "update": (1, 1)},
    "exact pipelined": {"sample": (2, 2), "update": (0, 0)},
    "local": {"sample": (0, 0), "update": (0, 0)},
}


@pytest.mark.parametrize("world", [int(w) for w in os.environ.get("ROUND_TRIP_WORLDS", "4,8").split(",")])
def test_round_trips_per_exchange_do_not_grow_with_the_ranks(world: int) -> None:
    results = run_ranks(_cases, world, timeout_s=600)
    for rank, cases in enumerate(results):
        assert cases["exact"]["foreign"] > 0  # exact batches hold other shards' keys: they travel
        assert cases["local"]["foreign"] == 0  # local batches hold only this rank's keys
        for case, calls in EXPECTED.items():
            for call, (collectives, round_trips) in calls.items():
                got = cases[case][call]
                assert got["collectives"] == collectives, (rank, case, call, got)
                assert got["round_trips"] == round_trips, (rank, case, call, got)
                assert got["messages"] == collectives * (world - 1), (rank, case, call, got)


@pytest.mark.parametrize("hosts", [[0, 0, 1, 1], [0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 1, 1, 1, 1]])
def test_inter_host_messages_grow_with_the_hosts_not_the_ranks(hosts: list[int]) -> None:
    world, count = len(hosts), len(set(hosts))
    results = run_ranks(_cases, world, hosts, timeout_s=600)
    assert all(cases["exact"]["foreign"] > 0 for cases in results)  # records cross hosts
    for case, calls in EXPECTED.items():
        for call, (collectives, _) in calls.items():
            per_rank = [cases[case][call] for cases in results]  # [rank][counted call]: names
            for rank, made in enumerate(per_rank):
                leader = hosts.index(hosts[rank]) == rank
                for names in made:
                    assert names.count("collective") == collectives, (rank, case, call, names)
                    gloo = [n for n in names if n != "collective"]  # only the leaders' all_to_all
                    assert gloo == ["all_to_all_single"] * (collectives if leader else 0), (rank, case, call)
            # Inter-host messages per counted call, summed over the ranks: H (H - 1) per collective.
            sent = sum(names.count("all_to_all_single") for made in per_rank for names in made)
            messages = (count - 1) * sent  # each leader's all_to_all: a message to every other leader
            assert messages == collectives * count * (count - 1) * STEPS, (case, call)
