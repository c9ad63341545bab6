"""prefetch=k: one exchange serves k sample() calls, foreign priority updates are queued.

Real gloo ranks, the deterministic shards of :mod:`sharded_reference`. Checked: batches
drawn k at a time still follow the single-buffer P(i) with the single-buffer weights
(chi-square, exact and local mode); a learner step costs 1/k of the collectives; queued
updates land on their owners at the next exchange (before its draw) or at
flush_updates(); misuse raises ConfigError without a collective.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch.distributed as dist

import shardreplay as sr
from shardreplay.checkpoint import load, save
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.distributed.exchange import LocalExchange
from shardreplay.distributed.sharded_buffer import internals_of
from shardreplay.errors import ConfigError, InvalidPriorityError
from shardreplay.spec.keys import key_shard
from tests.distributed.sharded_reference import (
    ALPHA,
    AMOUNTS,
    BETA,
    CAPACITY,
    LAST,
    STREAMS,
    WINDOW,
    Reference,
    chi_square_pvalue,
    item_id,
    step_types,
    updated_priority,
    written_priority,
)
from tests.support import run_ranks

# One worker runs the module: its launches (a module fixture) are shared by its tests.
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("sharded_prefetch")]

SPEC = sr.Spec({"obs": sr.Field((), np.float32)})
PREFETCH, CALLS, BATCH = 4, 48, 1024
P_MIN = 1e-3


def _write(local: sr.ReplayBuffer, rank: int, stream: int, n: int) -> None:
    types = step_types(rank, stream, n)
    for t in range(n):
        i = item_id(rank, stream, t)
        local.add({"obs": np.array([i], np.float32), "step_type": types[t:t + 1],
                   "discount": np.array([0.0 if types[t] == LAST else 1.0], np.float32)},
                  stream_ids=[stream], priorities=[written_priority(i)])


def _logged(buf: ShardedReplayBuffer, log: list[str]) -> None:
    parts = internals_of(buf)  # the exchange group: shared memory on one host
    for comm in {id(c): c for c in (parts.collectives, parts.exchange_group)}.values():
        for name in ("all_gather", "all_reduce_sum", "all_to_all"):
            method = getattr(comm, name)
            setattr(comm, name, lambda *a, _m=method, **kw: (log.append(a[-1]), _m(*a, **kw))[1])


def _stored(local: sr.ReplayBuffer) -> dict[int, float]:
    arrays = local.state_dict()["arrays"]
    return dict(zip(arrays["field.obs"].numpy().astype(np.int64).tolist(), arrays["priority"].tolist(),
                    strict=True))


def _draws(buf: ShardedReplayBuffer) -> dict:
    ids, prob, w = [], [], []
    for _ in range(CALLS):
        b = buf.sample(BATCH)
        if (b.keys == -1).all():
            continue  # local mode on the empty shard
        ids.append(b.data["obs"][:, 0].numpy().astype(np.int64))
        prob.append(b.probabilities.numpy())
        w.append(b.weights.numpy())
    return {"ids": _cat(ids, np.int64), "prob": _cat(prob, np.float64), "w": _cat(w, np.float32)}


def _cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0, dtype)


def _scenario(rank: int, world: int, ckpt_root: str) -> dict:
    out: dict = {}
    # Ranks constructing with different depths all get ConfigError at construction.
    if world >= 2:
        try:
            ShardedReplayBuffer(sr.ReplayBuffer(SPEC, num_streams=1, stream_capacity=4, window=1),
                                timeout_s=60, prefetch=2 if rank == 0 else 3)
        except ConfigError as exc:
            out["depth_error"] = str(exc)
    local = sr.ReplayBuffer(SPEC, num_streams=STREAMS, stream_capacity=CAPACITY, window=WINDOW,
                            sampler="prioritized", alpha=ALPHA, beta=BETA, seed=300 + rank)
    # K = 2 exchanges records through all_to_all, K = 4 through shared memory.
    bufs = {mode: ShardedReplayBuffer(local, timeout_s=120, seed=17 + rank, prefetch=PREFETCH,
                                      shared_memory=world != 2, mode=mode) for mode in ("exact", "local")}
    buf = bufs["exact"]
    log: list[str] = []
    for each in bufs.values():
        _logged(each, log)
    for stream, n in enumerate(AMOUNTS[world][rank]):
        _write(local, rank, stream, n)

    out["draws"], out["collectives"] = {}, {}
    for mode in ("exact", "local"):
        start = len(log)
        out["draws"][mode] = _draws(bufs[mode])
        out["collectives"][mode] = log[start:]

    # Updates: own ones land at once, foreign ones wait (no collective) for flush_updates().
    b = buf.sample(64)
    ids = b.data["obs"][:, 0].numpy().astype(np.int64)
    own = key_shard(b.keys.numpy()) == rank
    start = len(log)
    out["own_applied"] = buf.update_priorities(b.keys, updated_priority(ids))
    out["own_expected"] = int(own.sum())
    out["pending"] = buf.pending_updates
    out["foreign_expected"] = int((~own).sum())
    out["update_collectives"] = log[start:]
    out["updated_first"] = ids.tolist()
    out["stored_before_flush"] = _stored(local)
    out["flushed"] = buf.flush_updates()
    out["pending_after_flush"] = buf.pending_updates
    out["stored_after_flush"] = _stored(local)

    # A different size while prefetched batches wait: ConfigError, no collective.
    start = len(log)
    try:
        buf.sample(32)
    except ConfigError as exc:
        out["size_error"] = str(exc)
    # Bad priorities raise here and queue nothing.
    try:
        buf.update_priorities(b.keys, np.full(64, np.nan, np.float32))
    except InvalidPriorityError as exc:
        out["bad_error"] = str(exc)
    out["misuse_collectives"] = log[start:]
    out["pending_after_bad"] = buf.pending_updates

    # Updates queued while the prefetched batches are used go out with the next refill,
    # before its draw.
    second = []
    for _ in range(buf.prefetched):
        b = buf.sample(64)
        ids = b.data["obs"][:, 0].numpy().astype(np.int64)
        buf.update_priorities(b.keys, updated_priority(ids))
        second += ids.tolist()
    out["updated_second"] = second
    start = len(log)
    buf.sample(64)
    out["refill_collectives"] = log[start:]
    out["stored_after_refill"] = _stored(local)
    out["updates_applied"] = buf.info().updates_applied

    # A checkpoint load replaces the shard: prefetched batches and queued updates go.
    buf.update_priorities(buf.sample(64).keys, np.ones(64, np.float32))
    out["before_load"] = (buf.prefetched, buf.pending_updates)
    save(buf, ckpt_root, 1)
    dist.barrier()  # save has no collective: every part must exist before anyone loads
    load(ckpt_root, buf)
    out["after_load"] = (buf.prefetched, buf.pending_updates)
    out["after_load_batch"] = len(buf.sample(64))  # still in step
    gc.freeze()
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda k: f"K{k}")
def world(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict]]:
    return request.param, run_ranks(_scenario, request.param, str(tmp_path_factory.mktemp("ckpt")))


STATS = "ShardedReplayBuffer.sample(stats and queued updates)"
PAST_SLOT = "ShardedReplayBuffer.sample(queued updates past the slot)"
RECORDS = "ShardedReplayBuffer.sample(records)"
WRITTEN = "ShardedReplayBuffer.sample(records written)"


@pytest.mark.parametrize("mode", ["exact", "local"])
def test_prefetched_batches_follow_the_single_buffer_distribution(world, mode: str) -> None:
    k, results = world
    ref = Reference(k, set())  # no updates before these draws
    p_ref, w_ref = ref.probabilities(True), ref.weights(True)
    fraction = ref.shard_mass_fraction(True)
    for rank, r in enumerate(results):
        d = r["draws"][mode]
        if mode == "local" and fraction[rank] == 0:
            assert len(d["ids"]) == 0
            continue
        assert len(d["ids"]) == CALLS * BATCH
        pos = ref.index(d["ids"])
        np.testing.assert_allclose(d["prob"], p_ref[pos], rtol=1e-9)
        factor = 1.0 if mode == "exact" else k * fraction[rank]
        np.testing.assert_allclose(d["w"], w_ref[pos] * factor, rtol=2e-6)
        if mode == "exact":
            assert chi_square_pvalue(d["ids"], ref.ids, p_ref) > P_MIN
            # Each batch is i.i.d. over shards, not one shard per batch: every batch of
            # the first refill holds items of every non-empty shard.
            owners = d["ids"][:PREFETCH * BATCH].reshape(PREFETCH, BATCH) // 1000
            assert all(set(np.unique(o)) == set(np.flatnonzero(fraction > 0)) for o in owners)
        else:
            mine = ref.owner == rank
            assert chi_square_pvalue(d["ids"], ref.ids[mine], p_ref[mine] / fraction[rank]) > P_MIN


def test_a_learner_step_costs_one_kth_of_the_collectives(world) -> None:
    k, results = world
    refills = CALLS // PREFETCH
    records = RECORDS if k == 2 else WRITTEN
    for r in results:
        # shared memory (K != 2): growing an area costs no collective (no region name to remove)
        assert r["collectives"]["exact"] == [STATS, records] * refills
        # local mode: only every agree_every-th exchange agrees (the others draw with no collective)
        assert r["collectives"]["local"] == [STATS] * len(range(0, refills, LocalExchange.agree_every))
        assert r["collectives"] == results[0]["collectives"]
        assert r["update_collectives"] == []


def test_queued_updates_land_on_their_owner_at_flush(world) -> None:
    k, results = world
    updated = {i for r in results for i in r["updated_first"]}
    for rank, r in enumerate(results):
        assert r["own_applied"] == r["own_expected"]
        assert r["pending"] == r["foreign_expected"] and r["pending_after_flush"] == 0
        mine_updated = {i for i in r["updated_first"] if i // 1000 == rank}
        for i, p in r["stored_before_flush"].items():
            want = updated_priority(i) if i in mine_updated else written_priority(i)
            assert p == pytest.approx(float(want)), (rank, i)
        for i, p in r["stored_after_flush"].items():
            want = updated_priority(i) if i in updated else written_priority(i)
            assert p == pytest.approx(float(want)), (rank, i)
    assert sum(r["flushed"] for r in results) == sum(r["foreign_expected"] for r in results)
    if k >= 2:
        assert sum(r["foreign_expected"] for r in results) > 0


def test_the_next_refill_routes_queued_updates_before_drawing(world) -> None:
    k, results = world
    updated = {i for r in results for i in r["updated_first"] + r["updated_second"]}
    # Every update of every rank was applied once, on its owner (none is stale here).
    assert sum(r["updates_applied"] for r in results) == sum(
        len(r["updated_first"]) + len(r["updated_second"]) for r in results)
    for r in results:
        assert r["refill_collectives"] == [
            STATS, PAST_SLOT, RECORDS if k == 2 else WRITTEN]  # no slot yet: a second all_to_all
        for i, p in r["stored_after_refill"].items():
            want = updated_priority(i) if i in updated else written_priority(i)
            assert p == pytest.approx(float(want)), i


def test_a_checkpoint_load_discards_prefetched_batches_and_queued_updates(world) -> None:
    k, results = world
    for r in results:
        assert r["before_load"][0] == PREFETCH - 2  # two of the last refill were used
        assert r["after_load"] == (0, 0) and r["after_load_batch"] == 64
    if k >= 2:
        assert sum(r["before_load"][1] for r in results) > 0


def test_misuse_raises_without_a_collective(world) -> None:
    k, results = world
    for r in results:
        assert "prefetched batches" in r["size_error"] and "(32, 'exact')" in r["size_error"]
        assert "finite" in r["bad_error"]
        assert r["misuse_collectives"] == [] and r["pending_after_bad"] == 0
        if k >= 2:
            assert "different prefetch depths" in r["depth_error"]
