"""The exchange group's collectives through shared memory (``distributed/same_host.py``),
on real processes of one host (gloo ranks on loopback, free ports).

They give what gloo gives (all_gather rows, all_to_all sections, messages of several rounds),
keep the ``Collectives`` contract (``issued``, ``while_waiting``, ``released``), time out
naming the op and rank when a peer never arrives, give ``PeerLost`` at once when a peer is
SIGKILLed, and leave no name in /dev/shm after setup, close or a crash.
"""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch.distributed as dist

from shardreplay.distributed.group import Collectives
from shardreplay.distributed.same_host import CHUNK, SHM_DIR, SameHost, nonce
from shardreplay.errors import CollectiveTimeout, PeerLost
from tests.support import run_ranks
from tests.support.ports import free_port
from tests.support.ranks import _child, rank_context

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not os.access(SHM_DIR, os.W_OK), reason="needs a writable /dev/shm")]


def _groups(rank: int, world: int, timeout_s: float = 60.0) -> tuple[Collectives, Collectives, list[int]]:
    """The default gloo group's collectives and their shared-memory copy; every rank's nonce."""
    comm = Collectives(timeout_s=timeout_s)
    mine = nonce()
    host = SameHost(mine, rank, world)
    nonces = comm.all_gather(np.array([mine]), "nonces").reshape(-1)
    return comm, comm.shared_copy(host, nonces), nonces.tolist()


def _names(nonces: list[int]) -> list[str]:
    return sorted(p.name for n in nonces for p in SHM_DIR.glob(f"shardreplay-{n:016x}-*"))


def _calls(comm: Collectives, rank: int, world: int, log: list[str]) -> list[np.ndarray]:
    """The same collectives on ``comm`` (``log``: what ran while waiting and released)."""

    @contextlib.contextmanager
    def released() -> Iterator[None]:
        log.append("released")
        yield

    big = CHUNK // 2 + 1000  # several rounds per message
    sizes = [[(s + r) % 3 for r in range(world)] for s in range(world)]  # rows s sends r (0 too)
    large = [[big + 77 * (s + r) for r in range(world)] for s in range(world)]
    row = np.arange(3 * sum(sizes[rank]), dtype=np.int64).reshape(-1, 3) + 1000 * rank
    blob = np.random.default_rng(rank).integers(0, 256, sum(large[rank]), np.uint8)
    return [
        comm.all_gather(np.arange(7) + 10 * rank, "ints", while_waiting=lambda: log.append("ran")),
        comm.all_gather(np.full((3, 4), rank + 0.5, np.float64), "floats", released=released),
        comm.all_gather(np.full((CHUNK + 1000,), rank, np.uint8), "rounds"),
        comm.all_to_all(row, sizes[rank], [sizes[s][rank] for s in range(world)], "rows"),
        comm.all_to_all(blob, large[rank], [large[s][rank] for s in range(world)], "large rows"),
        comm.all_to_all(np.empty((0, 2)), [0] * world, [0] * world, "nothing"),
    ]


def _same_results(rank: int, world: int) -> dict:
    comm, shm, nonces = _groups(rank, world)
    assert shm.same_host is not None
    for size in (100, 10_000):  # an area that grows maps the file again, and drops a map
        shm.same_host.records(rank, size)
    gc.collect()
    logs: tuple[list[str], list[str]] = ([], [])
    want = _calls(comm, rank, world, logs[0])
    if rank:  # rank 0 waits past a slice: it asks whether the others live (they do)
        time.sleep(0.3)
    got = _calls(shm, rank, world, logs[1])
    out = {"equal": [a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(want, got, strict=True)],
           "shapes": [tuple(a.shape) for a in got], "issued": shm.issued, "logs": logs,
           "names_set_up": _names(nonces)}  # every rank has passed the setup
    shm.destroy()
    out["names_closed"] = _names(nonces)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_collectives_give_what_gloo_gives(world: int) -> None:
    for rank, r in enumerate(run_ranks(_same_results, world)):
        assert r["equal"] == [True] * 6, (rank, r["shapes"])
        assert r["shapes"][:3] == [(world, 7), (world, 3, 4), (world, CHUNK + 1000)]
        assert r["issued"] == 6  # counted as gloo's are
        assert r["logs"][1] == r["logs"][0] == ["ran", "released"]
        assert r["names_set_up"] == r["names_closed"] == []  # removed once every rank mapped them


def _absent_peer(rank: int, world: int) -> dict:
    _, shm, _ = _groups(rank, world, timeout_s=2.0)
    out: dict = {}
    if rank == 0:
        start = time.monotonic()
        try:
            shm.all_gather(np.ones(2), "the absent peer's op")
        except CollectiveTimeout as exc:
            out = {"type": type(exc).__name__, "error": str(exc), "seconds": time.monotonic() - start}
    dist.barrier()  # rank 1 lives (and never joins the shared-memory collective) until then
    return out


def test_a_peer_that_never_arrives_times_out_naming_the_op_and_rank() -> None:
    rank0, _ = run_ranks(_absent_peer, 2)
    assert rank0["type"] == "CollectiveTimeout", rank0  # alive, so not PeerLost
    assert "the absent peer's op did not complete within 2 s on rank 0 of 2" in rank0["error"]
    assert 2.0 <= rank0["seconds"] < 3.5, rank0


def _killed_peer(rank: int, world: int) -> dict:
    _, shm, nonces = _groups(rank, world, timeout_s=60.0)
    shm.all_gather(np.ones(2), "warm-up")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    start = time.monotonic()
    try:
        shm.all_gather(np.ones(2), "after the crash")
    except PeerLost as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start, "nonces": nonces}
    return {"error": None}


def test_a_killed_peer_gives_peer_lost_at_once_and_leaves_no_names() -> None:
    from shardreplay.runtime.actor.processes import stop_processes

    ctx, port = rank_context(), free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(_killed_peer, r, 2, port, (), out), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, status, r = out.get(timeout=120)
    except queue.Empty:
        rank, status, r = -1, "timed out", None
    finally:
        stop_processes(procs, timeout_s=5.0, grace_s=5.0)
        out.close()
    assert (rank, status) == (0, "ok"), r
    assert r["error"] is not None and r["seconds"] < 2.0, r  # the timeout is 60 s
    assert "after the crash failed on rank 0 of 2: rank 1 of this host's exchange group ended" in r["error"]
    assert _names(r["nonces"]) == []
