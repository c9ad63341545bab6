"""The console entry keeps ``train``'s stop handlers to the process's end.

A SIGTERM that came after ``train`` had printed its final line, while the interpreter was
exiting, used to find the default handler put back and killed a finished run (exit -15,
seen in CI's signal matrix, "final checkpoint and evaluation").
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

# ``train`` stands in for a finished run; atexit runs after main() returned, as interpreter
# shutdown does, and signals the process then.
_SCRIPT = """
import atexit, os, runpy, signal, sys
import shardreplay.cli.train as train

def finished(args):
    atexit.register(lambda: (os.kill(os.getpid(), signal.{sig}), print("exited cleanly", flush=True)))
    print("final line", flush=True)
    return 0

train.run = finished
sys.argv = ["shardreplay", "train"]
runpy.run_module("shardreplay", run_name="__main__")
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_after_train_finished_does_not_kill_the_exit(sig: str) -> None:
    """``python -m shardreplay train`` exits 0 when a stop signal arrives during its exit."""
    done = subprocess.run([sys.executable, "-c", _SCRIPT.format(sig=sig)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.splitlines() == ["final line", "exited cleanly"]


def test_in_process_main_puts_the_handlers_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """``main(["train", ...])`` called as a library (the tests' way) leaves the caller's
    handlers as they were."""
    import shardreplay.cli.train as train
    from shardreplay.cli.main import main

    monkeypatch.setattr(train, "run", lambda args: 0)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    assert main(["train"]) == 0
    assert {s: signal.getsignal(s) for s in before} == before
