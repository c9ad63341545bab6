"""Starting a training run: learner ranks here (forked from a preloaded server) or under
torchrun (``RANK`` / ``WORLD_SIZE`` set: this process is one rank). Stops, a rank that
dies, and why no process outlives the launcher: docs/semantics.md, "A learner rank that dies".
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import logging
import os
import queue
import signal
import socket
import time
import traceback
from pathlib import Path
from typing import Any

from shardreplay import _signals
from shardreplay._io import atomic_write_bytes, storage_error
from shardreplay.checkpoint import checkpoint_dir, latest_complete, list_checkpoints, set_aside
from shardreplay.checkpoint.manifest import INCOMPLETE_DIR
from shardreplay.errors import CheckpointError, ConfigError, PeerLost, ShardReplayError, StorageError
from shardreplay.runtime.actor.processes import (
    ProcessTree,
    children_block_signals,
    describe_exit,
    die_with_parent,
    resource_tracker_pid,
    stop_processes,
    stop_resource_tracker,
)
from shardreplay.runtime.algos import ACTIONS, spec_of
from shardreplay.runtime.envs import describe_env
from shardreplay.runtime.forkserver import (
    parent_or_exit,
    preloaded_context,
    release_server,
    server_pid,
    start_server,
    stop_server,
    wait_until_ready,
)
from shardreplay.runtime.log_lines import configure_logging, exit_directly
from shardreplay.runtime.routing import check_reachable, check_writable, settings_transport
from shardreplay.runtime.run_identity import upcoming_life, write_life
from shardreplay.runtime.settings import TrainSettings
from shardreplay.spec import Spec
from shardreplay.transport.urls import parse_medium

log = logging.getLogger("shardreplay.train")
# After a rank failed, the others get this long to save their parts and stop their
# actors (the learner gives its actors 10 s at most) before they are killed.
_FAILURE_GRACE_S = 20.0
_POLL_S = 0.1  # how soon a dead learner is noticed
LEARNER_PRELOAD = "shardreplay.runtime.launch.learner_preload"


def under_torchrun() -> bool:
    """True when torchrun (or another launcher) set RANK and WORLD_SIZE."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def prepare_run_dir(settings: TrainSettings, resume: bool, *, auto_resume: bool = False) -> TrainSettings:
    """Create the run directory and, for a new run, write ``config.json`` and ``run.json``
    (:mod:`shardreplay.runtime.run_identity`). A resumed run writes nothing here (its
    learners do once every rank restored:
    :func:`shardreplay.runtime.learner.checkpoints.commit_resume`). When ``auto_resume``
    starts afresh for want of a complete checkpoint, the incomplete ones are moved to
    ``checkpoints/incomplete/<UTC time>/`` (one log line says so).

    Raises:
        ConfigError: a new run (without ``auto_resume``) in a directory that already
            holds checkpoints, or several torchrun ranks without an explicit (shared)
            ``run_dir``.
        CheckpointError: incomplete checkpoints could not be moved aside.
    """
    if not settings.run.run_dir and under_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
        raise ConfigError("under torchrun every learner rank needs the same --run-dir "
                          "(a directory all ranks share: a volume or network file system)")
    run_dir = Path(settings.run.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    root = run_dir / "checkpoints"
    settings = settings.with_run_dir(run_dir)
    first_rank = not under_torchrun() or os.environ.get("RANK") == "0"
    if resume:
        if first_rank:
            ident = upcoming_life(run_dir, settings.transport.run_id)
            log.info("%s: run %s, learner life %d (recorded once every rank restored)", run_dir,
                     ident.run_id, ident.life)
        return settings
    if list_checkpoints(root):
        _refuse_fresh_start(run_dir, auto_resume)
    if auto_resume and first_rank:
        # One rank moves them, before the ranks meet (nobody saves before that).
        moved, where = set_aside(root)
        if moved:
            names = ", ".join(checkpoint_dir(root, c).name for c in moved)
            log.warning("%s: no complete checkpoint: starting the run afresh; %d incomplete "
                        "checkpoint(s) (%s) moved to %s", run_dir, len(moved), names, where)
    run_dir.mkdir(parents=True, exist_ok=True)
    if first_rank:
        # Before the ranks meet: every learner reads it once they have (Learner.__init__).
        ident = upcoming_life(run_dir, settings.transport.run_id)
        log.info("%s: run %s, learner life %d", run_dir, ident.run_id, ident.life)
        write_life(run_dir, ident, settings.stored())
    return settings


def _refuse_fresh_start(run_dir: Path, auto_resume: bool) -> None:
    """A new run where checkpoints are: refused, unless ``auto_resume`` found only
    incomplete ones (those are set aside)."""
    root = run_dir / "checkpoints"
    if latest_complete(root) is not None:
        raise ConfigError(f"{run_dir} already holds checkpoints: continue it with --resume {run_dir} "
                          f"(or --run-dir {run_dir} --auto-resume), or start a new run with another "
                          "--run-dir")
    if not auto_resume:
        names = ", ".join(checkpoint_dir(root, c).name for c in list_checkpoints(root))
        raise ConfigError(f"{run_dir} holds only incomplete checkpoints ({names}: a run stopped before "
                          f"every rank saved): start it again with --run-dir {run_dir} --auto-resume "
                          f"(they are moved to {root / INCOMPLETE_DIR}), or use another --run-dir")


def train(settings: TrainSettings, resume: bool = False, *, auto_resume: bool = False,
          checkpoint_id: int | None = None, replay: bool = True) -> dict[str, Any]:
    """Run a training job to its end; returns rank 0's summary. ``replay`` False
    (``--no-replay``): a resume takes back weights, optimizer and counters, not the
    replay; ``auto_resume``: see :func:`prepare_run_dir`.

    Raises:
        ConfigError: bad settings (checked before anything starts).
        ShardReplayError: a learner rank failed (its error is in the message) or died
            (named with its pid and signal: "rank 1 (pid N) died with SIGKILL").
    """
    for url in {settings.transport.url, settings.transport.policy_url}:
        check_reachable(url)  # an unreachable Redis fails here, in seconds
        check_writable(url)  # an unwritable spool too, before the run directory is made
    spec = refuse_before_start(settings)
    if under_torchrun() and settings.learners.count != int(os.environ["WORLD_SIZE"]):
        # torchrun decides the number of learner ranks; shards and stream rows follow it.
        if settings.learners.count != 1:
            log.warning("--learners %d ignored: torchrun started %s ranks", settings.learners.count,
                        os.environ["WORLD_SIZE"])
        settings = settings.updated({"learners": int(os.environ["WORLD_SIZE"])})
    if _signals.requested() is not None and not under_torchrun():
        # Ctrl-C or SIGTERM while the command was starting (_signals.take_over took it): the
        # run directory is left as it was. (A torchrun rank goes on to meet the others
        # and stops with them: leaving alone would make them wait for it.)
        return _stopped_during_startup(settings.run.run_dir)
    try:
        settings = prepare_run_dir(settings, resume, auto_resume=auto_resume)
    except OSError as exc:  # a read-only or full run directory: one line, no traceback
        raise storage_error(exc, settings.run.run_dir) or exc from None
    # How every rank's Learner starts (its keyword arguments besides the transport).
    how = {"resume": resume, "checkpoint_id": checkpoint_id, "replay": replay}
    return _torchrun_rank(settings, how) if under_torchrun() else _spawn_learners(settings, spec, how)


def refuse_before_start(settings: TrainSettings) -> Spec:
    """The Spec the run's actors write; before a run directory or process exists, it
    refuses an environment the algorithm cannot train on and a CUDA device this machine
    does not have (torch is imported only when a device other than ``cpu`` is asked for).

    Raises:
        ConfigError: one of those, saying what to give instead.
    """
    name = settings.learners.algo
    spec = spec_of(name, describe_env(settings.run.source, ACTIONS[name]), settings.learners.hidden)
    for flag, device in (("--device", settings.learners.device), ("--actor-device", settings.actors.device)):
        if device != "cpu":
            from shardreplay.runtime.devices import check_cuda

            check_cuda(flag, device)
    return spec


def _stopped_during_startup(run_dir: str) -> dict[str, Any]:
    """The summary of a run stopped before its learners met: nothing trained or saved."""
    log.warning("stopped while starting; nothing new was trained or saved")
    return {"stopped_during_startup": True, "run_dir": run_dir}


def _torchrun_rank(settings: TrainSettings, how: dict[str, Any]) -> dict[str, Any]:
    importlib.import_module(LEARNER_PRELOAD)  # what a learner imports, imported as the fork server does
    import torch.distributed as dist

    # gloo even on GPU machines: the learner keeps its network and batches on the CPU,
    # and NCCL only reduces CUDA tensors.
    dist.init_process_group("gloo", init_method="env://",
                            timeout=datetime.timedelta(seconds=settings.learners.collective_timeout_s))
    try:
        from shardreplay.runtime.learner.loop import Learner

        return Learner(settings, **how).run()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _learner_main(rank: int, settings: TrainSettings, port: int, rings: list[Any] | None, out: Any,
                  launcher_pid: int, how: dict[str, Any]) -> None:
    release_server()  # the fork server now ends with the launcher, and this rank learns of it
    die_with_parent()
    parent = parent_or_exit(launcher_pid)
    _signals.install({signal.SIGINT: signal.SIG_IGN})  # the launcher turns Ctrl-C into SIGTERM
    # Born with SIGTERM blocked (see _spawn_learners): take it from here on (the Learner's
    # loop stops on it, however early it came), then let it in.
    _signals.take_over(parent)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    configure_logging(logging.INFO if rank == 0 else logging.WARNING,
                      f"%(asctime)s rank {rank} %(name)s: %(message)s")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=settings.learners.count,
                            timeout=datetime.timedelta(seconds=settings.learners.collective_timeout_s))
    code = 0
    try:
        if _stop_agreed_on_meeting():
            out.put((rank, "ok", {"rank": rank, "stopped_during_startup": True,
                                  "run_dir": settings.run.run_dir}))
            return
        from shardreplay.runtime.learner.loop import Learner

        summary = Learner(settings, rings[rank] if rings else None, rings=rings, **how).run()
        out.put((rank, "ok", summary))
    except BaseException as exc:
        code = 1
        from shardreplay.distributed.group import lost_peer_error, peer_lost

        if peer_lost(exc):  # DDP's all-reduce in backward: the raw gloo text otherwise
            exc = lost_peer_error(exc, f"training failed on rank {rank} of {settings.learners.count}")
        refused = storage_error(exc)
        if refused is not None:  # a full or read-only disk: the launcher's one line names it
            exc = refused
        elif isinstance(exc, PeerLost):
            log.error("%s", exc)  # where it failed matters less than which peer stopped
        elif isinstance(exc, (CheckpointError, ConfigError)):
            pass  # a refusal, not a bug: its message, in the launcher's one line, says it all
        else:
            traceback.print_exc()
        out.put((rank, "error", f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()
        out.close()
        out.join_thread()
        exit_directly(code)


def _stop_agreed_on_meeting() -> bool:
    """Whether some rank was asked to stop before the ranks met (one all-reduce): then
    all leave at once, before building anything (a stop that comes later is the loop's)."""
    import torch
    import torch.distributed as dist

    votes = torch.tensor([int(_signals.requested() is not None)], dtype=torch.int64)
    dist.all_reduce(votes)
    return int(votes.item()) > 0


def _spawn_learners(settings: TrainSettings, spec: Spec, how: dict[str, Any]) -> dict[str, Any]:
    # A tracker already running belongs to the caller (its other resources depend on
    # it); otherwise the queue's semaphores start one here, and it is ours to stop.
    own_tracker = resource_tracker_pid() is None
    # Likewise a fork server already running is the caller's (then without our preload,
    # only slower): ours is stopped at the end, the caller's left alone.
    own_server = server_pid() is None
    # What every learner imports, imported once (see learner_preload).
    ctx = preloaded_context([LEARNER_PRELOAD])
    out = ctx.Queue()
    port = _free_port()
    local = parse_medium(settings.transport.url).kind == "local"
    # Kept referenced here while children run: Process.start() drops its args, and a
    # collected ring would unlink its semaphores before a child has opened them.
    transports = [settings_transport(settings, spec, r) if local else None
                  for r in range(settings.learners.count)]
    procs = [ctx.Process(target=_learner_main, name=f"learner-{r}", daemon=False,
                         args=(r, settings, port, transports if local else None, out, os.getpid(), how))
             for r in range(settings.learners.count)]
    stopping = {"asked": False}
    # The tracker is not signalled: closing its pipe lets it unlink what leaked, then exit.
    tree = ProcessTree(exclude=lambda: {pid for pid in [resource_tracker_pid(), server_pid()]
                                        if pid is not None})
    outcome: dict[str, Any] | ShardReplayError | None = None

    def forward(*_args: Any) -> None:
        if not stopping["asked"]:
            stopping["asked"] = True
            log.warning("stopping: every learner checkpoints, then exits")
            _terminate(procs)

    restore = _signals.install({signal.SIGINT: forward, signal.SIGTERM: forward})
    if _signals.requested() is not None:  # taken before this handler was there
        forward()
    try:
        started = _start_learners(procs, stopping)
        if stopping["asked"] and len(started) < len(procs):
            # Stopped while the learners were being started: those started cannot meet
            # the others, and hold nothing yet (no learner exists before they meet).
            for learner in started:
                learner.kill()
            outcome = _stopped_during_startup(settings.run.run_dir)
        else:
            if stopping["asked"]:
                # The stop may have come while a learner was being started (its handler ran
                # before that process had a pid): tell them all again, SIGTERM is idempotent.
                _terminate(procs)
            outcome = _collect(started, out, stopping, tree, settings.run.run_dir)
    finally:
        restore()
        tree.scan()
        # After a failure the ranks had their grace already: what is left is killed.
        failed = isinstance(outcome, ShardReplayError)
        stop_processes([p for p in procs if p.pid is not None], timeout_s=1.0 if failed else 60.0)
        procs.clear()  # one never started still holds its ring and the queue (released below)
        # What the learners left: actors of a rank that died (reparented, so only the
        # record finds them), or of one killed after its grace.
        killed = tree.stop(timeout_s=2.0)
        if killed:
            log.warning("killed %d process(es) left by the learners: %s", len(killed), ", ".join(killed))
        # Release the rings' and the queue's semaphores while the tracker still listens,
        # then end it: it must not outlive the launcher either.
        transports.clear()
        out.close()
        out.join_thread()
        del out
        if own_server:
            stop_server()
        if own_tracker:
            stop_resource_tracker()
    if isinstance(outcome, ShardReplayError):
        # Raised only now: its traceback would hold the queue, whose semaphores must be
        # released before the tracker stops.
        raise outcome
    return outcome  # set: _collect returned


def _start_learners(procs: list[Any], stopping: dict[str, bool]) -> list[Any]:
    """Start the learner processes in order until a stop is asked; returns those started.
    (A function of its own: a loop variable left in the caller would keep a process never
    started, and the ring and queue its arguments hold, alive.)"""
    # SIGTERM too stays pending in a learner until its handler is in place: a learner
    # killed by it while importing would leave the others waiting to meet it. The learners
    # are forked by the server, so it is the server that starts with both blocked.
    with children_block_signals({signal.SIGINT, signal.SIGTERM}):
        ready = start_server()
    # Its preload (torch) is waited for here, where this process's handlers run: inside
    # start() a stop would wait for it, 30 s and more on a loaded machine.
    if not wait_until_ready(ready, lambda: stopping["asked"]):
        return []
    for p in procs:
        if stopping["asked"]:
            break
        with children_block_signals({signal.SIGINT, signal.SIGTERM}):
            p.start()
    return [p for p in procs if p.pid is not None]


def _collect(procs: list[Any], out: Any, stopping: dict[str, bool], tree: ProcessTree,
             run_dir: str) -> dict[str, Any] | ShardReplayError:
    """Rank 0's summary once every learner reported, or the error to raise once the tree
    is stopped (the rank that failed, with pid and signal when it died, then what the
    others reported). A failure stops the others (:func:`_stop_after_failure`)."""
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}  # rank -> its report, in the order they came
    deaths: list[str] = []
    while len(results) < len(procs) and not errors and not deaths:
        _take_rest(out, results, errors, timeout_s=_POLL_S)
        tree.scan()
        if any(p.exitcode is not None for p in procs):
            _take_rest(out, results, errors)  # reports sent just before the exits
            deaths = _failures(procs, results, errors, stopping["asked"])
            if all(p.exitcode is not None for p in procs):
                break
    if errors or deaths:
        _stop_after_failure(procs, out, results, errors, deaths, tree)
        return _failure(deaths, errors, run_dir)
    if 0 not in results:  # every rank ended on the SIGTERM sent after a stop: nothing saved
        return _stopped_during_startup(run_dir)
    # A rank whose file system refused a write: the run's last line names the first.
    refused = [r.get("storage_error") for _, r in sorted(results.items()) if r.get("storage_error")]
    if refused and not results[0].get("storage_error"):
        _name_refusal_in_summary(run_dir, refused[0])
    return {**results[0], "storage_error": refused[0] if refused else None}


def _name_refusal_in_summary(run_dir: str, error: str) -> None:
    """Add to rank 0's summary.json the write another rank's file system refused (rank 0
    names only its own; which rank meets a full disk first is a matter of timing). Without
    a summary, or where it cannot be rewritten, the run's last line still names it."""
    path = Path(run_dir) / "summary.json"
    with contextlib.suppress(OSError, ValueError):
        summary = json.loads(path.read_text())
        atomic_write_bytes(path, json.dumps({**summary, "storage_error": error}, indent=1).encode())


_STORAGE = f"{StorageError.__name__}: "


def _failure(deaths: list[str], errors: dict[int, str], run_dir: str) -> ShardReplayError:
    """The error to raise: a :class:`StorageError` (its one line, and what to do) when
    every failure was a write the file system refused, else the deaths and the ranks'
    reports (ranks that failed alike in one entry)."""
    again = f"--run-dir {run_dir} --auto-resume"
    if not deaths and all(e.startswith(_STORAGE) for e in errors.values()):
        first = next(iter(errors.values()))[len(_STORAGE):]
        return StorageError(f"{first}; free space (or make it writable), then continue the run with {again}")
    by_error: dict[str, list[int]] = {}
    for rank, error in errors.items():
        by_error.setdefault(error, []).append(rank)
    reports = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}: {error}"
               for error, ranks in by_error.items()]
    return ShardReplayError(f"training failed: {'; '.join([*deaths, *reports])}. The other ranks and every "
                            f"actor were stopped; continue the run with {again}")


def _stop_after_failure(procs: list[Any], out: Any, results: dict[int, Any], errors: dict[int, str],
                        deaths: list[str], tree: ProcessTree) -> None:
    """SIGTERM the ranks still running (each saves its part without collectives, stops
    its actors and exits) and wait up to ``_FAILURE_GRACE_S``, taking their reports."""
    first = deaths[0] if deaths else next(f"rank {r}: {e}" for r, e in errors.items())
    if _STORAGE in first:  # the refused write is the command's last line: not named twice
        first = first.split(":")[0] + ": the file system refused a write"
    log.error("%s: stopping the other ranks (each saves its part) and every actor", first)
    _terminate(procs)
    deadline = time.monotonic() + _FAILURE_GRACE_S
    while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
        _take_rest(out, results, errors, timeout_s=_POLL_S)
        tree.scan()
    _take_rest(out, results, errors)
    # A rank that exited on our SIGTERM is no further failure; one that died otherwise is.
    for line in _failures(procs, results, errors, True):
        if line not in deaths:
            deaths.append(line)


def _terminate(procs: list[Any]) -> None:
    """SIGTERM the learners started and still running."""
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)


def _take_rest(out: Any, results: dict[int, Any], errors: dict[int, str], timeout_s: float = 0.0) -> None:
    """Take the reports queued now (waiting up to ``timeout_s`` for the first)."""
    while True:
        try:
            rank, status, value = out.get(timeout=timeout_s) if timeout_s > 0 else out.get_nowait()
        except queue.Empty:
            return
        timeout_s = 0.0
        if status == "ok":
            results[rank] = value
        else:
            errors[rank] = value


def _failures(procs: list[Any], results: dict[int, Any], errors: dict[int, str],
              stop_asked: bool) -> list[str]:
    """Learners that exited without a report, named with pid and how they ended
    ("rank 1 (pid 4242) died with SIGKILL"); SIGTERM after a stop request is no failure."""
    failed = [(rank, p) for rank, p in enumerate(procs)
              if p.exitcode is not None and rank not in results and rank not in errors
              and not (stop_asked and p.exitcode == -signal.SIGTERM)]
    return [f"rank {rank} (pid {p.pid}) {describe_exit(p.exitcode)}"
            + ("" if p.exitcode < 0 else " without a report") for rank, p in failed]
