"""stop_processes: started processes get a grace period, then SIGTERM, then SIGKILL;
descendant_pids: the process tree as psutil sees it, from the tree's own /proc files."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import threading
import time

import psutil

from shardreplay.runtime.actor.processes import ProcessTree, descendant_pids, stop_processes


def _ignore_sigterm_and_sleep() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)


def test_each_process_ends_by_the_gentlest_step_that_works() -> None:
    ctx = mp.get_context("fork")
    quick = ctx.Process(target=time.sleep, args=(0.2,))
    sleeper = ctx.Process(target=time.sleep, args=(60,))
    stubborn = ctx.Process(target=_ignore_sigterm_and_sleep)
    procs = [quick, sleeper, stubborn]
    for p in procs:
        p.start()
    time.sleep(0.3)  # the stubborn one has installed its handler
    start = time.monotonic()
    stop_processes(procs, timeout_s=1.0, grace_s=1.0)
    took = time.monotonic() - start
    assert [p.exitcode for p in procs] == [0, -signal.SIGTERM, -signal.SIGKILL]
    assert not any(p.is_alive() for p in procs)
    assert took < 10  # one shared grace period, not one per process


def test_descendant_pids_is_the_tree_psutil_sees_children_of_threads_included() -> None:
    """Grandchildren, and a child started by a thread other than the main one (the
    kernel lists it under that thread's task), are found; a process killed is gone."""
    # An xdist worker may hold children of earlier tests (a session's redis-server).
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    shell = ["sh", "-c", "sleep 30 & sleep 30 & wait"]
    started: list[subprocess.Popen[bytes]] = [subprocess.Popen(shell)]
    thread = threading.Thread(target=lambda: started.append(subprocess.Popen(["sleep", "30"])))
    thread.start()
    thread.join()
    try:
        expected = {started[0].pid, started[1].pid}
        deadline = time.monotonic() + 10
        while len(psutil.Process(started[0].pid).children()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # the shell starts its two sleeps
        expected |= {c.pid for c in psutil.Process(started[0].pid).children()}
        assert len(expected) == 4
        found = descendant_pids(os.getpid())
        assert found is not None, "this Linux lists no /proc/<pid>/task/<tid>/children"
        # This process may have children of earlier tests too (an xdist worker): the same
        # tree as psutil's, and this test's four in it.
        assert expected <= set(found)
        others = set(found) - {c.pid for c in psutil.Process().children(recursive=True)}
        assert all(_zombie_or_gone(pid) for pid in others), others
        tree = ProcessTree()
        tree.scan()
        assert {p.pid for p in tree.alive()} - before == expected
    finally:
        for p in started:
            p.kill()
            p.wait()
    for c in expected - {p.pid for p in started}:  # the shell's sleeps, reparented
        with contextlib.suppress(psutil.Error):
            psutil.Process(c).kill()
    assert set(descendant_pids(os.getpid()) or []) & expected == set()


def _zombie_or_gone(pid: int) -> bool:
    """An earlier test's child that psutil no longer lists as a descendant."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
