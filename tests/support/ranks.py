"""Run a function on K real gloo ranks (processes on loopback), collect results; the
``torchrun`` command line for a script or module on loopback.

The ranks are fresh processes forked from a fork server (one per test process, started
on first use) that has imported torch and loaded shardreplay's kernels
(:mod:`tests.support.preload`): like ``spawn`` they share nothing with the test process
but their pickled arguments, and each starts in a fraction of a second instead of the
3-4 CPU-seconds those imports cost every spawned rank.

Every child is joined, and on failure or timeout terminated and killed, so no test
leaves a process behind.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import sys
import traceback
from collections.abc import Callable
from typing import Any

from tests.support.ports import free_port


def _child(fn: Callable, rank: int, world: int, port: int, args: tuple, out: Any,
           place: tuple[str, str, str] = ("", "127.0.0.1", "lo")) -> None:
    namespace, address, ifname = place
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    import torch.distributed as dist

    try:
        if namespace:
            from netns import enter  # benchmarks/net/ is on sys.path (pyproject: pythonpath)

            enter(namespace)
        dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        result = fn(rank, world, *args)
        out.put((rank, "ok", result))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_context() -> Any:
    """The multiprocessing context the ranks start in: a fork server preloaded with torch
    and shardreplay (its environment is this process's at its first use)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.support.preload"])
    return ctx


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 180.0,
              places: list[tuple[str, str, str]] | None = None, port: int | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``places`` (one per rank): ``(network namespace, rank 0's address, interface)`` to run
    the ranks in network namespaces (``benchmarks/net/netns.py``); default loopback.

    Raises:
        AssertionError: a rank raised (its traceback is in the message) or timed out.
    """
    ctx = rank_context()
    out = ctx.Queue()
    port = port or free_port()
    places = places or [("", "127.0.0.1", "lo")] * world_size
    from shardreplay.runtime.actor.processes import stop_processes  # lazily: ranks re-import this module

    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, out, places[r]), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, status, value = out.get(timeout=timeout_s)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    except queue.Empty:
        errors.append(f"timed out after {timeout_s} s; finished ranks: {sorted(results)}")
    finally:
        stop_processes(procs, timeout_s=5.0, grace_s=10 if not errors else 0.5)
        out.close()
    assert not errors, "\n".join(errors)
    return [results[r] for r in range(world_size)]


def torchrun(nproc: int, *target: str) -> list[str]:
    """``python -m torch.distributed.run`` with ``nproc`` ranks on loopback (a rendezvous on
    a free port of this worker's own), then ``target`` (a script and its arguments, or
    ``-m module ...``)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *target]
