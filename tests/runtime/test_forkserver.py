"""The learners' fork server (:mod:`shardreplay.runtime.forkserver`): children start with
what it preloaded, and none outlives a starter that is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from shardreplay.runtime.actor.processes import die_with_parent
from shardreplay.runtime.forkserver import (
    parent_or_exit,
    preloaded_context,
    release_server,
    server_pid,
    stop_server,
)

ROOT = Path(__file__).resolve().parents[2]


def _report(starter: int, out: object) -> None:
    release_server()
    die_with_parent()
    parent = parent_or_exit(starter)
    out.put((parent, "xml.dom.minidom" in sys.modules))  # type: ignore[attr-defined]


def test_a_child_starts_with_the_preloaded_modules_and_the_server_as_parent() -> None:
    stop_server()  # one this worker started for other tests (tests/support/ranks.py): ours preloads
    ctx = preloaded_context(["xml.dom.minidom"])
    out = ctx.Queue()
    p = ctx.Process(target=_report, args=(os.getpid(), out))
    try:
        p.start()
        parent, preloaded = out.get(timeout=60)
        p.join(30)
        assert p.exitcode == 0
        assert preloaded, "the module the server imported is not in the child"
        assert parent == server_pid() and parent != os.getpid()
    finally:
        stop_server()
    assert server_pid() is None


def _sleep_forever(starter: int, pid_file: str) -> None:
    release_server()
    die_with_parent()
    parent_or_exit(starter)
    Path(pid_file).write_text(str(os.getpid()))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    time.sleep(300)


STARTER = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from shardreplay.runtime.forkserver import preloaded_context, server_pid
    from tests.runtime.test_forkserver import _sleep_forever
    if __name__ == "__main__":
        ctx = preloaded_context([])
        pid_file = Path(sys.argv[1])
        p = ctx.Process(target=_sleep_forever, args=(os.getpid(), str(pid_file)))
        p.start()
        while not pid_file.exists():
            time.sleep(0.05)
        print(server_pid(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
""")


def test_no_child_outlives_a_starter_killed_by_sigkill(tmp_path: Path) -> None:
    """The server ends with its starter (each child closed its copy of the server's
    keep-alive pipe), so its children get PR_SET_PDEATHSIG and end too."""
    pid_file, out = tmp_path / "child.pid", tmp_path / "out.txt"
    with open(out, "w") as f:  # a file, not a pipe: the starter's end is what is waited for
        code = subprocess.run([sys.executable, "-c", STARTER, str(pid_file)], cwd=ROOT, stdout=f,
                              stderr=subprocess.STDOUT, timeout=120).returncode
    assert code == -signal.SIGKILL, out.read_text()
    server, child = int(out.read_text().split()[0]), int(pid_file.read_text())
    deadline = time.monotonic() + 20
    alive = [server, child]
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if psutil.pid_exists(pid)
                 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.05)
    for pid in alive:  # leave nothing behind, then fail
        os.kill(pid, signal.SIGKILL)
    assert alive == [], f"left running after the starter was killed: {alive} (server {server}, child {child})"
