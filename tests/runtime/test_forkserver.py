"""The learners' fork server (:mod:`shardreplay.runtime.forkserver`): children start with
what it preloaded, and none outlives a starter that is SIGKILLed."""

from __future__ import annotations

import json
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


WAIT = """
import json, os, sys, time
from shardreplay.runtime.forkserver import (preloaded_context, server_pid, start_server, stop_server,
                                            wait_until_ready)
from shardreplay.transport.local import pid_alive
preloaded_context([sys.argv[1]])
path = start_server()
t0 = time.monotonic()
ready = wait_until_ready(path, lambda: time.monotonic() - t0 > float(sys.argv[2]))  # a stop asked then
waited = time.monotonic() - t0
pid = server_pid()
stop_server()
alive = pid_alive(pid)  # after the stop: killed and reaped, or ended
print(json.dumps({"ready": ready, "waited": waited, "alive": alive, "stopped": time.monotonic() - t0,
                  "file_left": os.path.exists(path)}))
"""


def test_a_stop_while_the_server_imports_its_preload_ends_the_wait_and_the_server(tmp_path: Path) -> None:
    """The launcher waits for the learners' fork server to import torch with its signal
    handlers free to run: a stop asked meanwhile kills the server (no child forked yet)
    at once, instead of waiting for an import that takes 30 s and more on a loaded
    machine. A server whose preload ends first is waited for and used as before."""
    (tmp_path / "slow_preload.py").write_text(
        "import time\nfrom shardreplay.runtime.forkserver import mark_ready\ntime.sleep(120)\nmark_ready()\n")
    (tmp_path / "quick_preload.py").write_text(
        "from shardreplay.runtime.forkserver import mark_ready\nmark_ready()\n")
    results = {}
    for module, stop_after_s in (("slow_preload", "1.0"), ("quick_preload", "60.0")):
        # On PYTHONPATH: the server imports its preload with the environment's path.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-c", WAIT, module, stop_after_s], env=env,
                              capture_output=True, text=True, timeout=100, check=False)
        assert proc.returncode == 0, proc.stderr
        results[module] = json.loads(proc.stdout.strip().splitlines()[-1])
    slow, quick = results["slow_preload"], results["quick_preload"]
    assert slow["ready"] is False and not slow["alive"], slow
    assert slow["stopped"] < 10.0, slow  # not the preload's 120 s
    assert quick["ready"] is True and quick["waited"] < 60.0, quick
    assert not slow["file_left"] and not quick["file_left"]
