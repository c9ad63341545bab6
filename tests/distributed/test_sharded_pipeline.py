"""pipeline=True: exchanges on a background thread over the buffer's own process group.

Real gloo ranks, the deterministic shards of :mod:`sharded_reference`, a real DDP model
all-reducing gradients on the default group between samples. Checked: pipelined exact
sampling still draws the single-buffer P(i) with the single-buffer weights (chi-square);
a priority update of step t changes the draw of step t+2 and not of step t+1; a
checkpoint save and load with a draw in flight; an error in one rank's exchange reaches
every rank at its next call and stops the thread; SIGTERM (the learner's stop path) and
close() end the thread; asking for another batch size raises ConfigError.
"""

from __future__ import annotations

import gc
import os
import signal

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import shardreplay as sr
from shardreplay.checkpoint import list_checkpoints, load, save
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.distributed.sharded_buffer import internals_of
from shardreplay.errors import CollectiveTimeout, ConfigError, SamplerFailed
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
    written_priority,
)
from tests.support import run_ranks

# One worker runs the module: its launches (a module fixture) are shared by its tests.
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("sharded_pipeline")]

SPEC = sr.Spec({"obs": sr.Field((), np.float32)})
CALLS, BATCH = 48, 1024
P_MIN = 1e-3
HOT = 1e6  # a priority that makes one item nearly the whole distribution


def _write(buf: ShardedReplayBuffer, rank: int, stream: int, start: int, stop: int) -> None:
    types = step_types(rank, stream, stop)
    for t in range(start, stop):
        i = item_id(rank, stream, t)
        buf.add({"obs": np.array([i], np.float32), "step_type": types[t:t + 1],
                 "discount": np.array([0.0 if types[t] == LAST else 1.0], np.float32)},
                stream_ids=[stream], priorities=[written_priority(i)])


def _buffer(rank: int, world: int, **kwargs) -> ShardedReplayBuffer:
    local = sr.ReplayBuffer(SPEC, num_streams=STREAMS, stream_capacity=CAPACITY, window=WINDOW,
                            sampler="prioritized", alpha=ALPHA, beta=BETA, seed=500 + rank)
    buf = ShardedReplayBuffer(local, seed=31 + rank, pipeline=True, **{"timeout_s": 60, **kwargs})
    for stream, n in enumerate(AMOUNTS[world][rank]):
        _write(buf, rank, stream, 0, n)
    return buf


def _ddp_step(model: DistributedDataParallel, batch: sr.Batch) -> None:
    """A gradient all-reduce on the default group between two samples (as a learner does)."""
    x = batch.data["obs"][:, :1].float() / 1000.0
    (model(x) * batch.weights[:, None]).mean().backward()
    model.zero_grad(set_to_none=True)


def _scenario(rank: int, world: int, ckpt_root: str) -> dict:
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    out: dict = {}
    buf = _buffer(rank, world, shared_memory=world != 2)
    out["draws"] = _draws(buf, model)
    _staleness(buf, rank, world, model, out)
    _change_of_size(buf, out)
    _checkpoint_in_flight(buf, rank, ckpt_root, out)
    buf.close()
    out["closed_thread_alive"] = internals_of(buf).runner.alive
    try:
        buf.sample(8)
    except ConfigError as exc:
        out["after_close"] = str(exc)
    _failure(rank, world, out)
    gc.freeze()
    return out


def _draws(buf: ShardedReplayBuffer, model: DistributedDataParallel) -> dict:
    ids, prob, w = [], [], []
    for _ in range(CALLS):
        b = buf.sample(BATCH)
        _ddp_step(model, b)
        ids.append(b.data["obs"][:, 0].numpy().astype(np.int64))
        prob.append(b.probabilities.numpy())
        w.append(b.weights.numpy())
    return {"ids": np.concatenate(ids), "prob": np.concatenate(prob), "w": np.concatenate(w)}


def _staleness(buf: ShardedReplayBuffer, rank: int, world: int, model: DistributedDataParallel,
               out: dict) -> None:
    """The last rank gives one item of another shard priority HOT after step 0's batch: the
    batch of step 1 was drawn before that (the item is rare), the batch of step 2 after
    (it is nearly every item)."""
    b0 = buf.sample(BATCH)
    obs0 = b0.data["obs"][:, 0].numpy().astype(np.int64)
    foreign = np.flatnonzero(key_shard(b0.keys.numpy()) != rank)
    hot = int(obs0[foreign[0]]) if rank == world - 1 else -1
    _ddp_step(model, b0)
    if rank == world - 1:
        buf.update_priorities(b0.keys[foreign[:1]], np.array([HOT], np.float32))
    else:
        buf.update_priorities(b0.keys[:0], np.empty(0, np.float32))
    hot_t = torch.tensor([hot], dtype=torch.float64)
    dist.all_reduce(hot_t, op=dist.ReduceOp.MAX)
    hot = int(hot_t.item())
    shares = []
    for _ in range(2):
        b = buf.sample(BATCH)
        _ddp_step(model, b)
        shares.append(float((b.data["obs"][:, 0].numpy().astype(np.int64) == hot).mean()))
        buf.update_priorities(b.keys[:0], np.empty(0, np.float32))
    out["hot_share_step1"], out["hot_share_step2"] = shares


def _change_of_size(buf: ShardedReplayBuffer, out: dict) -> None:
    try:
        buf.sample(BATCH // 2)
    except ConfigError as exc:
        out["size_error"] = str(exc)
    buf.discard_prefetched()
    out["after_discard"] = len(buf.sample(BATCH // 2))


def _checkpoint_in_flight(buf: ShardedReplayBuffer, rank: int, root: str, out: dict) -> None:
    """Save and load while the next batch's exchange is in flight: both wait for it, the
    load drops it, and batches drawn afterwards name the loaded content (no stale keys)."""
    buf.sample(BATCH // 2)
    out["in_flight_before_save"] = internals_of(buf).runner.in_flight
    save(buf, root, 1)
    out["prefetched_after_save"] = buf.prefetched
    dist.barrier()
    buf.sample(BATCH // 2)  # served from what the save kept; starts another exchange
    load(root, buf, checkpoint_id=1)
    out["in_flight_after_load"] = internals_of(buf).runner.in_flight or buf.prefetched > 0
    stale, applied = buf.local.info().stale_updates, buf.info().updates_applied
    for _ in range(3):
        b = buf.sample(BATCH // 2)
        buf.update_priorities(b.keys, np.full(len(b.keys), 2.0, np.float32))
    buf.flush_updates()
    dist.barrier()
    out["stale_after_load"] = buf.local.info().stale_updates - stale
    out["applied_after_load"] = buf.info().updates_applied - applied


def _failure(rank: int, world: int, out: dict) -> None:
    """Rank 0's exchange raises before its first collective: rank 0 gets SamplerFailed at
    its next sample, the others a CollectiveTimeout (their exchange's peer never came),
    and every later call on every rank SamplerFailed; close() still ends the thread."""
    buf = _buffer(rank, world, timeout_s=3)
    buf.sample(64)
    buf.settle()  # the exchange started by that call is done, unbroken: one batch waits
    if rank == 0:
        def broken(*_args, **_kwargs):
            raise RuntimeError("injected failure in the exchange")
        internals_of(buf).strategy.draw = broken
    buf.sample(64)  # served from the waiting batch; starts the broken exchange
    try:
        buf.sample(64)
    except (SamplerFailed, CollectiveTimeout) as exc:
        out["first_error"] = type(exc).__name__
        out["first_cause"] = repr(exc.__cause__)
    try:
        buf.sample(64)
    except SamplerFailed as exc:
        out["second_error"] = str(exc)
    buf.close()
    out["failed_thread_alive"] = internals_of(buf).runner.alive


@pytest.fixture(scope="module", params=[2, 4], ids=lambda k: f"K{k}")
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    k = request.param
    root = tmp_path_factory.mktemp(f"pipeline-K{k}")
    return k, run_ranks(_scenario, k, str(root), timeout_s=240), Reference(k, set())


def test_pipelined_exact_sampling_draws_the_single_buffer_distribution(world) -> None:
    k, results, ref = world
    p_ref, w_ref = ref.probabilities(True), ref.weights(True)
    ids = np.concatenate([r["draws"]["ids"] for r in results])
    assert len(ids) == k * CALLS * BATCH
    assert chi_square_pvalue(ids, ref.ids, p_ref) > P_MIN
    for r in results:
        pos = ref.index(r["draws"]["ids"])
        np.testing.assert_allclose(r["draws"]["prob"], p_ref[pos], rtol=1e-9)
        np.testing.assert_allclose(r["draws"]["w"], w_ref[pos], rtol=2e-6)


def test_an_update_of_step_t_lands_before_the_draw_of_step_t_plus_2(world) -> None:
    _k, results, _ref = world
    for r in results:
        assert r["hot_share_step1"] < 0.3, r
        assert r["hot_share_step2"] > 0.95, r


def test_another_batch_size_needs_discard_prefetched(world) -> None:
    _k, results, _ref = world
    for r in results:
        assert "discard_prefetched()" in r["size_error"] and "pipeline=True" in r["size_error"]
        assert r["after_discard"] == BATCH // 2


def test_checkpoint_save_and_load_with_a_draw_in_flight(world) -> None:
    _k, results, _ref = world
    for r in results:
        assert r["in_flight_before_save"]
        assert r["prefetched_after_save"] == 1  # the save waited for it and kept it
        assert not r["in_flight_after_load"]  # the load dropped what named the old content
        assert r["stale_after_load"] == 0
    assert sum(r["applied_after_load"] for r in results) > 0


def test_close_ends_the_thread(world) -> None:
    _k, results, _ref = world
    for r in results:
        assert r["closed_thread_alive"] is False
        assert "closed" in r["after_close"]


def test_an_error_in_one_ranks_exchange_reaches_every_rank(world) -> None:
    _k, results, _ref = world
    assert results[0]["first_error"] == "SamplerFailed"
    assert "injected failure" in results[0]["first_cause"]
    for r in results[1:]:
        assert r["first_error"] in ("CollectiveTimeout", "PeerLost")
    for r in results:
        assert "cannot sample any more" in r["second_error"]
        assert r["failed_thread_alive"] is False


# -- SIGTERM: the learner's stop path -------------------------------------------------------------
def _sigterm(rank: int, world: int, ckpt_root: str) -> dict:
    """Rank 0 gets SIGTERM with an exchange in flight. As in the learner, the handler only
    sets a flag, the ranks agree on it through the default group, and then every rank
    flushes, saves its part and closes the buffer, with writes going on between samples."""
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_a: stop.__setitem__("flag", True))
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    buf = _buffer(rank, world)
    steps = 0
    for steps in range(1, 200):
        b = buf.sample(256)
        _ddp_step(model, b)
        buf.update_priorities(b.keys, np.ones(len(b.keys), np.float32))
        n = AMOUNTS[world][rank][2] + steps - 1  # stream 2 goes on: the learner's thread
        _write(buf, rank, 2, n, n + 1)  # writes while the exchange draws
        if rank == 0 and steps == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        flag = torch.tensor([float(stop["flag"])])
        dist.all_reduce(flag)
        if flag.item() > 0:
            break
    in_flight = internals_of(buf).runner.in_flight
    buf.flush_updates()
    save(buf, ckpt_root, steps)
    buf.close()
    return {"steps": steps, "in_flight": in_flight, "alive": internals_of(buf).runner.alive}


def test_sigterm_stops_every_rank_cleanly(tmp_path) -> None:
    results = run_ranks(_sigterm, 2, str(tmp_path), timeout_s=120)
    for r in results:
        assert r == {"steps": 5, "in_flight": True, "alive": False}
    assert list_checkpoints(tmp_path) == [5]
