"""shardreplay._signals: a stop signal taken while a process starts is kept for the code
that knows how to stop (issue 19, item 4). Each case runs in a child process of its own:
the record is process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.slow  # fresh interpreters or many examples: 20-100 s at load ~9 on 2 cores
def test_a_signal_taken_early_is_recorded_and_reaches_the_learner_trigger() -> None:
    proc = _run("""
        import os, signal
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job starts
        from shardreplay import _signals
        restore = _signals.take_over()
        assert _signals.requested() is None
        os.kill(os.getpid(), signal.SIGINT)  # ignored before: now recorded
        os.kill(os.getpid(), signal.SIGTERM)  # would have killed the process
        assert _signals.requested() == signal.SIGINT, _signals.requested()
        import pathlib, tempfile
        from shardreplay.runtime.learner.sync import learner_trigger
        from shardreplay.runtime.settings import TrainSettings
        trigger = learner_trigger(TrainSettings(), pathlib.Path(tempfile.mkdtemp()))
        assert trigger.stop_requested, "a stop taken before the learner's handlers is lost"
        os.kill(os.getpid(), signal.SIGINT)  # a repeated Ctrl-C still only asks to stop
        assert trigger.stop_requested
        restore()
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_redeliver_gives_the_signal_its_default_effect() -> None:
    proc = _run("""
        import os, signal, sys
        # The effect "it would have had" is the one the process started with: make that
        # the default. A suite started as a background job (`make test &` in a script)
        # passes SIGINT ignored down to this child, which then rightly prints nothing.
        inherited = (signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, []))
        print("inherited", inherited, file=sys.stderr)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        from shardreplay import _signals
        restore = _signals.take_over()
        os.kill(os.getpid(), signal.SIGINT)
        try:
            _signals.redeliver(restore)
        except KeyboardInterrupt:
            print("interrupted")
    """)
    assert proc.stdout.strip() == "interrupted", (proc.returncode, proc.stderr)


def test_a_child_whose_parent_is_gone_exits_on_the_signal() -> None:
    proc = _run("""
        import os, signal
        from shardreplay import _signals
        _signals.take_over(parent_pid=os.getppid() + 1_000_000)  # not its parent
        os.kill(os.getpid(), signal.SIGTERM)
        print("still running")
    """)
    assert proc.returncode == 1 and "still running" not in proc.stdout, (proc.stdout, proc.stderr)
    assert "is gone: exiting" in proc.stderr
