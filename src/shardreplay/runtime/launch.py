"""Starting a training run: learner ranks here (spawned) or under torchrun.

``train(settings)`` on one machine spawns ``settings.learners`` learner processes that
form a gloo group on loopback; each starts the actors of its shard. Under ``torchrun``
(``RANK`` / ``WORLD_SIZE`` set) this process is one learner rank of the group torchrun
made (NCCL when CUDA is there, gloo otherwise).

Ctrl-C / SIGTERM: the launcher forwards SIGTERM to the learners, which agree to stop,
checkpoint (every rank), stop their actors and exit; stragglers are killed after a
grace period. No process outlives the launcher.
"""

from __future__ import annotations

import datetime
import json
import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import time
from pathlib import Path
from typing import Any

from shardreplay.errors import ShardReplayError
from shardreplay.runtime.envs import env_spaces, transition_spec
from shardreplay.runtime.processes import die_with_parent, stop_processes
from shardreplay.runtime.routing import chunk_bytes, scheme_of, shard_transport
from shardreplay.runtime.settings import TrainSettings

log = logging.getLogger("shardreplay.train")


def under_torchrun() -> bool:
    """True when torchrun (or another launcher) set RANK and WORLD_SIZE."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def prepare_run_dir(settings: TrainSettings, resume: bool) -> TrainSettings:
    """Create the run directory and write ``config.json`` (not on resume)."""
    run_dir = Path(settings.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    settings = settings.with_run_dir(run_dir)
    if not resume or not (run_dir / "config.json").exists():
        (run_dir / "config.json").write_text(json.dumps(settings.to_dict(), indent=1))
    return settings


def train(settings: TrainSettings, resume: bool = False) -> dict[str, Any]:
    """Run a training job to its end; returns rank 0's summary.

    Raises:
        ConfigError: bad settings (checked before anything starts).
        ShardReplayError: a learner rank failed (its error is in the message).
    """
    env_spaces(settings.env_id)  # a bad environment fails here, before any process starts
    settings = prepare_run_dir(settings, resume)
    if under_torchrun():
        return _torchrun_rank(settings, resume)
    return _spawn_learners(settings, resume)


def _torchrun_rank(settings: TrainSettings, resume: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method="env://",
                            timeout=datetime.timedelta(seconds=settings.collective_timeout_s))
    try:
        from shardreplay.runtime.learner import Learner

        return Learner(settings, None, resume).run()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _learner_main(rank: int, settings: TrainSettings, port: int, transport: Any, resume: bool,
                  out: Any) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher turns Ctrl-C into SIGTERM
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s rank {rank} %(name)s: %(message)s")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=settings.learners,
                            timeout=datetime.timedelta(seconds=settings.collective_timeout_s))
    try:
        from shardreplay.runtime.learner import Learner

        summary = Learner(settings, transport, resume).run()
        out.put((rank, "ok", summary))
    except BaseException as exc:
        out.put((rank, "error", f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        dist.destroy_process_group()


def local_transport(settings: TrainSettings, spec: Any, shard: int) -> Any:
    """The ``local`` ring of one shard, sized for a short queue of its actors' chunks."""
    return shard_transport("local", spec, shard, queued_per_actor=settings.queued_chunks_per_actor,
                           actors=settings.actors_of_shard(shard),
                           chunk_size_bytes=chunk_bytes(spec, settings.envs_per_actor, settings.chunk_steps))


def _spawn_learners(settings: TrainSettings, resume: bool) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    spec = transition_spec(env_spaces(settings.env_id)[0])
    local = scheme_of(settings.transport) == "local"
    # Kept referenced here while children run: Process.start() drops its args, and a
    # collected ring would unlink its semaphores before a child has opened them.
    transports = [local_transport(settings, spec, r) if local else None for r in range(settings.learners)]
    procs = [ctx.Process(target=_learner_main, name=f"learner-{r}", daemon=False,
                         args=(r, settings, port, transports[r], resume, out))
             for r in range(settings.learners)]
    stopping = {"asked": False}

    def forward(*_args: Any) -> None:
        if not stopping["asked"]:
            stopping["asked"] = True
            log.warning("stopping: every learner checkpoints, then exits")
            for p in procs:
                if p.is_alive() and p.pid is not None:
                    os.kill(p.pid, signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for p in procs:
            p.start()
        return _collect(procs, out)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop_processes(procs, timeout_s=60.0)


def _collect(procs: list[Any], out: Any) -> dict[str, Any]:
    results: dict[int, Any] = {}
    errors: list[str] = []
    while len(results) + len(errors) < len(procs):
        try:
            rank, status, value = out.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
            if dead and not errors:
                errors.append(f"{dead[0].name} exited with code {dead[0].exitcode}")
            if errors and all(not p.is_alive() for p in procs):
                break
            continue
        if status == "ok":
            results[rank] = value
        else:
            errors.append(f"rank {rank}: {value}")
            break  # the others are stopped (and, if stuck in a collective, killed) by the caller
    if errors:
        raise ShardReplayError("training failed: " + "; ".join(errors))
    return results.get(0, {})
