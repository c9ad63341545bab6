"""The exchange group's collectives across emulated hosts (``distributed/hierarchy.py``): the
ranks of a host through shared memory, one leader per host over gloo. Real gloo ranks on
loopback (free ports), grouped into hosts by ``SHARDREPLAY_HOST`` (``same_host.host_key``).

They give what the flat gloo collectives give (K = 4 as 2 hosts of 2, K = 6 as 3 hosts of 2,
K = 5 as hosts of 3 and 2), keep the ``Collectives`` contract, and an exact sharded buffer
draws the same batches through them as over flat gloo for the same seeds; a SIGKILLed rank,
leader or not, gives ``PeerLost`` on every other rank at once; no name stays in /dev/shm.
"""

from __future__ import annotations

import os
import queue
import signal
import time
from typing import Any

import numpy as np
import pytest
import torch

import shardreplay as sr
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.distributed.group import Collectives
from shardreplay.distributed.same_host import SHM_DIR, SameHost, host_key, nonce
from shardreplay.distributed.sharded_buffer import internals_of
from shardreplay.errors import CollectiveTimeout, PeerLost
from shardreplay.spec.keys import unpack_keys
from tests.distributed.test_same_host import _calls
from tests.support import run_ranks
from tests.support.ports import free_port
from tests.support.ranks import _child, rank_context

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not os.access(SHM_DIR, os.W_OK), reason="needs a writable /dev/shm")]

LAYOUTS = {4: [0, 0, 1, 1], 6: [0, 0, 1, 1, 2, 2], 5: [0, 1, 0, 1, 0]}  # world -> host of each rank


def _hier(rank: int, hosts: list[int], timeout_s: float = 60.0) -> tuple[Collectives, Collectives]:
    """The default gloo group's collectives and their hierarchical copy over ``hosts``."""
    comm = Collectives(timeout_s=timeout_s)
    os.environ["SHARDREPLAY_HOST"] = f"emulated-{hosts[rank]}"
    host = SameHost(nonce(), rank, len(hosts))
    both = comm.all_gather(np.array([host.nonce, host_key(True)]), "nonces and host keys")
    return comm, comm.shared_copy(host, both[:, 0], both[:, 1])


def _names(nonces: list[int]) -> list[str]:
    return sorted(p.name for n in nonces for p in SHM_DIR.glob(f"shardreplay-{n:016x}-*"))


def _same_results(rank: int, world: int) -> dict:
    comm, hier = _hier(rank, LAYOUTS[world])
    logs: tuple[list[str], list[str]] = ([], [])
    want = _calls(comm, rank, world, logs[0])
    got = _calls(hier, rank, world, logs[1])
    sums = [c.all_reduce_sum(torch.arange(5, dtype=torch.int64) * (rank + 1), "sum") for c in (comm, hier)]
    out = {"equal": [a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(want, got, strict=True)],
           "sum": bool(torch.equal(*sums)), "issued": hier.issued, "logs": logs,
           "leader": hier.hierarchy is not None and hier.hierarchy.leaders is not None,
           "nonce": hier.hierarchy.local.nonce if hier.hierarchy is not None else None}
    hier.destroy()
    return out


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_hierarchical_collectives_give_what_flat_gloo_gives(world: int) -> None:
    results = run_ranks(_same_results, world)
    for rank, r in enumerate(results):
        assert r["equal"] == [True] * 6, rank
        assert r["sum"] and r["issued"] == 7
        assert r["logs"][1] == r["logs"][0] == ["ran", "released"]
    hosts = LAYOUTS[world]
    assert [r["leader"] for r in results] == [hosts.index(h) == i for i, h in enumerate(hosts)]
    assert _names([r["nonce"] for r in results]) == []  # removed once every rank mapped them


def _absent(rank: int, world: int) -> dict:
    comm, hier = _hier(rank, LAYOUTS[world], timeout_s=2.0)
    out: dict = {}
    if rank != 3:
        start = time.monotonic()
        try:
            hier.all_to_all(np.ones((world, 2)), [1] * world, [1] * world, "the absent rank's op")
        except CollectiveTimeout as exc:
            out = {"type": type(exc).__name__, "error": str(exc), "seconds": time.monotonic() - start}
    comm.timeout_s = 60.0
    comm.all_gather(np.ones(1), "the absent rank lives until then")  # not through the hierarchy
    return out


def test_a_rank_that_never_arrives_times_out_on_every_rank() -> None:
    """Rank 3 of 2 hosts of 2 never joins: its host's leader, the other leader and that
    leader's rank each wait for it (a hop on its host, the leaders' message, the hand-out)."""
    for rank, r in enumerate(run_ranks(_absent, 4)[:3]):
        assert r["type"] == "CollectiveTimeout", (rank, r)  # alive, so not PeerLost
        assert f"the absent rank's op did not complete within 2 s on rank {rank} of 4" in r["error"], r
        assert 1.9 <= r["seconds"] < 4.0, r  # gloo's wait may wake microseconds before its timeout


def _killed(rank: int, world: int, victim: int) -> dict:
    _, hier = _hier(rank, LAYOUTS[world])
    assert hier.hierarchy is not None
    hier.all_to_all(np.ones((world, 2)), [1] * world, [1] * world, "warm-up")
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    start = time.monotonic()
    try:
        hier.all_to_all(np.ones((world, 2)), [1] * world, [1] * world, "after the crash")
    except PeerLost as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start, "nonce": hier.hierarchy.local.nonce}
    return {"error": None}


@pytest.mark.parametrize(("world", "victim"), [(4, 1), (4, 2), (6, 5)])
def test_a_killed_rank_gives_peer_lost_on_every_other_rank_at_once(world: int, victim: int) -> None:
    """Rank 1 (not a leader) and rank 2 (host 1's leader) of 2 hosts of 2; rank 5 of 3 hosts."""
    from shardreplay.runtime.actor.processes import stop_processes

    ctx, port = rank_context(), free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(_killed, r, world, port, (victim,), out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world - 1:
            rank, status, r = out.get(timeout=120)
            results[rank] = (status, r)
    except queue.Empty:
        pass
    finally:
        stop_processes(procs, timeout_s=5.0, grace_s=5.0)
        out.close()
    assert sorted(results) == [r for r in range(world) if r != victim], results
    for rank, (status, r) in results.items():
        assert status == "ok" and r["error"] is not None, (rank, r)
        assert r["seconds"] < 5.0, (rank, r)  # the timeout is 60 s
        assert "after the crash failed on rank" in r["error"], r
    assert _names([r["nonce"] for _, r in results.values()]) == []


SPEC = sr.Spec({"obs": sr.Field((3,), np.float32)})


def _shard(rank: int) -> sr.ReplayBuffer:
    local = sr.ReplayBuffer(SPEC, num_streams=2, stream_capacity=64, window=3, sampler="prioritized",
                            alpha=0.6, beta=0.4, seed=rank)
    steps = 30 + 5 * rank  # uneven shards
    rng = np.random.default_rng(rank)
    types = np.ones((2, steps), np.uint8)
    types[:, 0], types[:, 17] = 0, 2  # FIRST, a LAST inside
    types[:, 18] = 0
    local.extend({"obs": rng.standard_normal((2, steps, 3)).astype(np.float32), "step_type": types,
                  "discount": np.ones((2, steps), np.float32)},
                 priorities=rng.uniform(0.1, 3.0, (2, steps)).astype(np.float32))
    return local


def _draws(rank: int, world: int, hierarchical: bool, pipeline: bool, prefetch: int,
           emulate: bool = True) -> dict:
    """Exact batches and their keys; ``emulate``: hosts by ``LAYOUTS`` (else the real host names)."""
    if hierarchical and emulate:
        os.environ["SHARDREPLAY_HOST"] = f"emulated-{LAYOUTS[world][rank]}"
    buf = ShardedReplayBuffer(_shard(rank), shared_memory=hierarchical, pipeline=pipeline, prefetch=prefetch)
    group = internals_of(buf).exchange_group
    rng = np.random.default_rng(100 + rank)
    keys, obs, weights = [], [], []
    for _ in range(6):
        batch = buf.sample(24 + rank)  # uneven batches
        shard, _tag, place, gen = unpack_keys(batch.keys.numpy())  # the tag is the buffer's own
        keys.append(np.stack([shard, place, gen]))
        obs.append(batch.data["obs"].numpy().copy())
        weights.append(batch.weights.numpy().copy())
        buf.update_priorities(batch.keys, rng.uniform(0.05, 4.0, len(batch.keys)).astype(np.float32))
    out = {"keys": keys, "obs": obs, "weights": weights, "len": len(buf),
           "hierarchy": group.hierarchy is not None, "same_host": group.same_host is not None}
    buf.close()
    return out


@pytest.mark.parametrize(("world", "pipeline", "prefetch"),
                         [(4, False, 1), (6, False, 1), (5, False, 2), (6, True, 1)])
def test_exact_sampling_draws_the_flat_paths_batches(world: int, pipeline: bool, prefetch: int) -> None:
    """Every batch alike, strict or prefetched; pipelined, the first (later ones are not
    reproducible even over flat gloo: a rank's updates of its own keys land while the
    thread draws the next batch, or after)."""
    flat = run_ranks(_draws, world, False, pipeline, prefetch)
    hier = run_ranks(_draws, world, True, pipeline, prefetch)
    for rank, (f, h) in enumerate(zip(flat, hier, strict=True)):
        assert (f["hierarchy"], h["hierarchy"], h["same_host"]) == (False, True, False)
        assert f["len"] == h["len"]
        for name in ("keys", "obs", "weights"):
            for a, b in list(zip(f[name], h[name], strict=True))[:1 if pipeline else None]:
                np.testing.assert_array_equal(a, b, err_msg=f"rank {rank} {name}")
