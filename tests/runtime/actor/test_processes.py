"""reap_processes: started processes get a grace period, then SIGTERM, then SIGKILL."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time

from shardreplay.runtime.actor.processes import reap_processes


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
    reap_processes(procs, grace_s=1.0, timeout_s=1.0)
    took = time.monotonic() - start
    assert [p.exitcode for p in procs] == [0, -signal.SIGTERM, -signal.SIGKILL]
    assert not any(p.is_alive() for p in procs)
    assert took < 10  # one shared grace period, not one per process
