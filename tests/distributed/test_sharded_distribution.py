"""The sharded buffer samples exactly the single-buffer distribution (docs/semantics.md, sampling rules 3-6).

Real gloo ranks, fixed seeds. Each world of K = 1, 2, 4 ranks holds uneven shards (one
empty for K >= 2, one with a wrapped ring); :mod:`sharded_reference` computes the
single-buffer P(i) and w_i over the union of all shards by brute force. One launch per K
runs every check, the ranks return what they saw, and the parent compares.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import shardreplay as sr
from shardreplay.buffer.nstep import nstep_returns
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.distributed.sharded_buffer import internals_of
from shardreplay.errors import ConfigError, EmptyBufferError, InvalidPriorityError
from shardreplay.spec.keys import unpack_keys
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
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("sharded_distribution")]

SPEC = sr.Spec({"obs": sr.Field((), np.float32)})
CALLS, BATCH = 60, 1024
MODES = (("prioritized", "exact"), ("prioritized", "local"), ("uniform", "exact"), ("uniform", "local"))
STALE_PRIORITY, BAD_PRIORITY, GOOD_PRIORITY = 2.55, 123.0, 7.5  # never written nor updated otherwise
P_MIN = 1e-3  # chi-square p-value floor (fixed seeds: the outcome is deterministic)


# -- what every rank runs -----------------------------------------------------------------------
def _write(local: sr.ReplayBuffer, rank: int, stream: int, start: int, stop: int) -> None:
    types = step_types(rank, stream, stop)
    for t in range(start, stop):
        i = item_id(rank, stream, t)
        local.add({"obs": np.array([i], np.float32), "step_type": types[t:t + 1],
                   "discount": np.array([0.0 if types[t] == LAST else 1.0], np.float32)},
                  stream_ids=[stream], priorities=[written_priority(i)])


def _record_collectives(buf: ShardedReplayBuffer, log: list[str]) -> None:
    """Log the name of every collective the buffer issues (to compare ranks' sequences)."""
    parts = internals_of(buf)  # the exchange group: shared memory on one host
    for comm in {id(c): c for c in (parts.collectives, parts.exchange_group)}.values():
        for name in ("all_gather", "all_reduce_sum", "all_to_all"):
            setattr(comm, name, _logged(getattr(comm, name), log))


def _logged(method, log: list[str]):
    def call(*args, **kwargs):
        log.append(args[-1] if isinstance(args[-1], str) else kwargs["op"])
        return method(*args, **kwargs)
    return call


def _draws(buf: ShardedReplayBuffer) -> dict:
    """CALLS batches: ids, probabilities, weights, bootstrap positions, per-call mean(w f)."""
    ids, prob, weights, boot, wf, window_ok, key_ok, padding = [], [], [], [], [], True, True, 0
    for _ in range(CALLS):
        b = buf.sample(BATCH)
        keys, obs, mask = b.keys.numpy(), b.data["obs"].numpy(), b.mask.numpy()
        w = b.weights.numpy()
        wf.append(float(np.mean(w * ((obs[:, 0].astype(np.int64) % 7) + 1))))
        if (keys == -1).all():  # local mode on an empty shard: the zero-weight padding batch
            padding += 1
            key_ok &= bool((w == 0).all() and (b.probabilities.numpy() == 0).all())
            # A DDP step computes n-step targets on padding too: they must come out finite.
            ret, boot_discount, _m = nstep_returns(b.data["obs"], b.data["discount"], b.mask, 0.99)
            key_ok &= bool(torch.isfinite(ret).all() and (boot_discount == 0).all())
            continue
        first = obs[:, 0].astype(np.int64)
        j = np.arange(WINDOW)
        window_ok &= bool(((obs == first[:, None] + j) | ~mask).all())
        shard, _tag, place, _gen = unpack_keys(keys)
        row, slot = np.divmod(place, CAPACITY)
        key_ok &= bool((shard == first // 1000).all() and (row == (first % 1000) // 100).all()
                       and (slot == (first % 100) % CAPACITY).all())
        ids.append(first)
        prob.append(b.probabilities.numpy())
        weights.append(w)
        boot.append(mask.sum(axis=1) - 1)
    return {"ids": _cat(ids, np.int64), "prob": _cat(prob, np.float64), "w": _cat(weights, np.float32),
            "m": _cat(boot, np.int64), "wf": np.array(wf), "window_ok": window_ok, "key_ok": key_ok,
            "padding": padding}


def _cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0, dtype)


def _stored(local: sr.ReplayBuffer) -> tuple[np.ndarray, np.ndarray]:
    """(ids, priorities) of every stored step of a shard, read from its state dict."""
    arrays = local.state_dict()["arrays"]
    return arrays["field.obs"].numpy().astype(np.int64), arrays["priority"].numpy().copy()


def _scenario(rank: int, world: int) -> dict:
    out: dict = {"log": []}
    bufs = {}
    for sampler in ("prioritized", "uniform"):
        local = sr.ReplayBuffer(SPEC, num_streams=STREAMS, stream_capacity=CAPACITY, window=WINDOW,
                                sampler=sampler, alpha=ALPHA, beta=BETA, seed=100 + rank)
        for mode in ("exact", "local"):  # two buffers over the one shard, one per mode
            bufs[sampler, mode] = ShardedReplayBuffer(local, timeout_s=120, seed=7 + rank, mode=mode)
            _record_collectives(bufs[sampler, mode], out["log"])
    pri, pri_local, uni = bufs["prioritized", "exact"], bufs["prioritized", "local"], bufs["uniform", "exact"]

    # All shards empty: every rank raises EmptyBufferError, and the ranks stay in step.
    out["empty_errors"] = 0
    for buf in (pri, pri_local):
        try:
            buf.sample(8)
        except EmptyBufferError:
            out["empty_errors"] += 1

    # Ranks that disagree on the mode all get ConfigError at construction (not garbage
    # at the first sample, not a hang).
    out["mode_mismatch"] = None
    if world >= 2:
        try:
            ShardedReplayBuffer(pri.local, timeout_s=120, mode="exact" if rank == 0 else "local")
        except ConfigError as exc:
            out["mode_mismatch"] = str(exc)

    for buf in (pri, uni):
        for stream, n in enumerate(AMOUNTS[world][rank]):
            _write(buf.local, rank, stream, 0, n)
    out["sizes"] = pri.global_sizes()

    # Priority updates from every rank, routed to the owners.
    b = pri.sample(64)
    ids = b.data["obs"][:, 0].numpy().astype(np.int64)
    out["updated"] = ids.tolist()
    out["applied"] = pri.update_priorities(b.keys, updated_priority(ids))
    out["stored"] = _stored(pri.local)

    out["draws"] = {f"{s}/{m}": _draws(bufs[s, m]) for s, m in MODES}
    # Local padding keys (-1) are skipped by update_priorities; other ranks apply their own.
    b = pri_local.sample(16)
    out["local_keys_padding"] = bool((b.keys == -1).all())
    out["local_applied"] = pri.update_priorities(b.keys, np.ones(16, np.float32))

    _stale_updates(pri, rank, out)
    _bad_priorities(pri, rank, world, out)
    out["final_batch"] = len(uni.sample(8))  # still in step after all of that
    out["shared_memory"] = internals_of(pri).strategy.uses_shared_memory
    gc.freeze()  # a faster exit: the interpreter's final collections skip frozen objects
    return out


def _stale_updates(pri: ShardedReplayBuffer, rank: int, out: dict) -> None:
    """Keys into rank 0's stream 0 go stale when rank 0 overwrites that whole ring."""
    keys = pri.sample(64).keys.numpy()
    shard, _tag, place, _gen = unpack_keys(keys)
    row = place // CAPACITY
    out["stale_expected"] = int(((shard == 0) & (row == 0)).sum())
    before = pri.local.info().stale_updates
    if rank == 0:
        n0 = int(pri.local.state_dict()["arrays"]["row_pos"][0])
        _write(pri.local, 0, 0, n0, n0 + CAPACITY)
    out["stale_applied"] = pri.update_priorities(keys, np.full(64, STALE_PRIORITY, np.float32))
    out["stale_counted"] = pri.local.info().stale_updates - before
    ids, prios = _stored(pri.local)
    out["stale_row0_untouched"] = bool(rank != 0 or not (prios[(ids % 1000) // 100 == 0]
                                                         == np.float32(STALE_PRIORITY)).any())


def _bad_priorities(pri: ShardedReplayBuffer, rank: int, world: int, out: dict) -> None:
    """Rank 1 (rank 0 alone) passes a NaN: only it raises, nothing of its input lands anywhere."""
    keys = pri.sample(64).keys
    prios = np.full(64, GOOD_PRIORITY, np.float32)
    if rank == min(1, world - 1):
        prios[:] = BAD_PRIORITY
        prios[-1] = np.nan
    out["bad_error"] = None
    try:
        pri.update_priorities(keys, prios)
    except InvalidPriorityError as exc:
        out["bad_error"] = str(exc)
    _ids, stored = _stored(pri.local)
    out["bad_landed"] = int((stored == np.float32(BAD_PRIORITY)).sum())
    out["good_landed"] = int((stored == np.float32(GOOD_PRIORITY)).sum())


# -- what the parent checks -------------------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(AMOUNTS), ids=lambda k: f"K{k}")
def world(request: pytest.FixtureRequest) -> tuple[int, list[dict], Reference]:
    """One launch per K; the reference knows which items were given new priorities."""
    k = request.param
    results = run_ranks(_scenario, k)
    updated = {i for r in results for i in r["updated"]}
    return k, results, Reference(k, updated)


def test_global_sizes_and_empty_buffer(world) -> None:
    k, results, ref = world
    steps = sum(min(n, CAPACITY) for amounts in AMOUNTS[k] for n in amounts)
    for r in results:
        assert r["empty_errors"] == 2
        assert r["sizes"] == (len(ref.ids), steps, k * STREAMS * CAPACITY)
        assert r["final_batch"] == 8


def test_ranks_disagreeing_on_the_mode_all_get_config_error(world) -> None:
    k, results, _ref = world
    for r in results:
        if k == 1:
            assert r["mode_mismatch"] is None
        else:
            assert "different modes" in r["mode_mismatch"]
            assert "rank 0: exact, rank 1: local" in r["mode_mismatch"]


def test_every_rank_issues_the_same_collectives(world) -> None:
    _k, results, _ref = world
    assert len(results[0]["log"]) > 4 * CALLS
    for r in results[1:]:
        assert r["log"] == results[0]["log"]


def test_priority_updates_land_on_the_owner(world) -> None:
    k, results, _ref = world
    updated = sorted({i for r in results for i in r["updated"]})  # sampled on any rank
    assert len(updated) > 10
    assert sum(r["applied"] for r in results) == 64 * k
    for rank, r in enumerate(results):
        ids, prios = r["stored"]  # the owner's own record of every stored step
        assert (ids // 1000 == rank).all()
        expected = np.where(np.isin(ids, updated), updated_priority(ids), written_priority(ids))
        np.testing.assert_array_equal(prios, expected.astype(np.float32))


@pytest.mark.parametrize("sampler", ["prioritized", "uniform"])
def test_exact_mode_draws_the_single_buffer_distribution(world, sampler: str) -> None:
    k, results, ref = world
    prioritized = sampler == "prioritized"
    draws = [r["draws"][f"{sampler}/exact"] for r in results]
    ids = np.concatenate([d["ids"] for d in draws])
    assert len(ids) == k * CALLS * BATCH
    assert all(d["window_ok"] and d["key_ok"] and d["padding"] == 0 for d in draws)
    p_ref, w_ref = ref.probabilities(prioritized), ref.weights(prioritized)
    assert chi_square_pvalue(ids, ref.ids, p_ref) > P_MIN
    for d in draws:
        pos = ref.index(d["ids"])
        np.testing.assert_allclose(d["prob"], p_ref[pos], rtol=1e-9)
        np.testing.assert_allclose(d["w"], w_ref[pos], rtol=2e-6)
        np.testing.assert_array_equal(d["m"], [ref.bootstrap[i] for i in d["ids"]])
    # Shards are hit in proportion to their mass; the empty one never.
    shares = np.bincount(ids // 1000, minlength=k) / len(ids)
    np.testing.assert_allclose(shares, ref.shard_mass_fraction(prioritized), atol=0.01)
    if k >= 2:
        assert shares[1] == 0


@pytest.mark.parametrize("sampler", ["prioritized", "uniform"])
def test_local_mode_weights_carry_the_shard_factor(world, sampler: str) -> None:
    k, results, ref = world
    prioritized = sampler == "prioritized"
    p_ref, w_ref = ref.probabilities(prioritized), ref.weights(prioritized)
    fraction = ref.shard_mass_fraction(prioritized)
    for rank, r in enumerate(results):
        d = r["draws"][f"{sampler}/local"]
        if fraction[rank] == 0:  # the empty shard: zero-weight padding every call
            assert d["padding"] == CALLS and d["key_ok"] and len(d["ids"]) == 0
            continue
        assert d["padding"] == 0 and d["window_ok"] and d["key_ok"]
        assert (d["ids"] // 1000 == rank).all()
        pos = ref.index(d["ids"])
        np.testing.assert_allclose(d["prob"], p_ref[pos], rtol=1e-9)
        np.testing.assert_allclose(d["w"], w_ref[pos] * k * fraction[rank], rtol=2e-6)
        mine = ref.owner == rank
        assert chi_square_pvalue(d["ids"], ref.ids[mine], p_ref[mine] / fraction[rank]) > P_MIN


@pytest.mark.parametrize("sampler", ["prioritized", "uniform"])
def test_local_mode_ddp_average_matches_exact_expectation(world, sampler: str) -> None:
    """DDP averages mean_b(w_b f_b) over ranks; its expectation is E_P[w f] in both modes."""
    _k, results, ref = world
    prioritized = sampler == "prioritized"
    f = (ref.ids % 7 + 1).astype(np.float64)
    target = float((ref.probabilities(prioritized) * ref.weights(prioritized) * f).sum())
    for mode in ("local", "exact"):
        per_call = np.mean([r["draws"][f"{sampler}/{mode}"]["wf"] for r in results], axis=0)
        se = per_call.std(ddof=1) / np.sqrt(CALLS)
        assert abs(per_call.mean() - target) < 5 * se + 1e-9, (mode, per_call.mean(), target, se)


def test_padding_keys_are_skipped(world) -> None:
    _k, results, ref = world
    fraction = ref.shard_mass_fraction(True)
    for rank, r in enumerate(results):
        assert r["local_keys_padding"] == (fraction[rank] == 0)
        assert r["local_applied"] == (0 if fraction[rank] == 0 else 16)


def test_stale_keys_are_ignored_and_counted_on_the_owner(world) -> None:
    _k, results, _ref = world
    expected = sum(r["stale_expected"] for r in results)
    assert expected > 0
    assert results[0]["stale_counted"] == expected
    assert all(r["stale_counted"] == 0 for r in results[1:])
    assert sum(r["stale_applied"] for r in results) == 64 * len(results) - expected
    assert all(r["stale_row0_untouched"] for r in results)


def test_bad_priorities_raise_on_that_rank_only(world) -> None:
    k, results, _ref = world
    for rank, r in enumerate(results):
        if rank == min(1, k - 1):
            assert r["bad_error"] is not None and "finite" in r["bad_error"]
        else:
            assert r["bad_error"] is None
        assert r["bad_landed"] == 0
    # The other ranks' updates were applied (K = 1: the only rank was the bad one).
    assert (sum(r["good_landed"] for r in results) > 0) == (k > 1)
