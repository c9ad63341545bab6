"""Runs ``shardreplay train`` as a terminal user would, and watches its process tree.

:class:`TrainRun` starts the command in a new session (so a test can signal its process
group as Ctrl-C does), writes stdout/stderr to files (a pipe nobody reads would block
the run), records every descendant process it ever sees (pid and start time, so a
reused pid is not mistaken for a leftover), and on :meth:`close` kills whatever of
the tree is still there: a failing test never leaves processes behind.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from shardreplay import checkpoint
from shardreplay.runtime.actor.processes import descendant_pids
from shardreplay.runtime.policy_file import learner_records

# A small network (flags given after these win): a step budget's updates with the default
# 256x256 MLP cost the learners about 10 CPU-seconds more per 2x2 run of 1,500 steps. No
# learning curve (about a CPU-second of matplotlib at each run's end): the tests that look
# at it (test_train_output, test_torchrun) ask for it with --plot.
_YOUNG_S = 3.0  # how long a new descendant's command line is read again

FAST = ("--no-progress", "--no-plot", "--eval-episodes", "2", "--eval-interval-updates", "100000",
        "--min-replay", "200", "--collective-timeout-s", "60", "--max-minutes", "4", "--hidden", "32", "32")
# FAST with train's own defaults for what a terminal user sees: the progress bar and the
# learning curve on (the fault matrices run each cell once more with these).
DEFAULTS = tuple(flag for flag in FAST if flag not in ("--no-progress", "--no-plot"))


def _descendant_pids(root: int) -> list[int]:
    """The pids under ``root`` now (by parent pid, as ``psutil``'s recursive children).

    From the tree's own ``/proc/<pid>/task/*/children`` files (see
    :func:`~shardreplay.runtime.actor.processes.descendant_pids`): the watcher calls this ten
    times a second per run, and one pass over every ``/proc/*/stat`` cost 2.2 ms a call (2%
    of a core per run) with a few hundred processes on the machine, on 2 shared cores."""
    pids = descendant_pids(root)
    if pids is not None:
        return pids
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split(maxsplit=2)[1])
        parents.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class TrainRun:
    """One ``python -m <module> <args>`` process tree (``shardreplay`` by default).

    Args:
        args: the command's arguments after the module (``train ...``).
        log_dir: where ``stdout.txt`` and ``stderr.txt`` go (``prefix`` before their names).
        env: extra environment variables.
        module: the module to run (``torch.distributed.run`` for torchrun).
        prefix: file name prefix of the outputs (several runs in one directory).
        sigint_ignored: start it with SIGINT ignored, as a shell starts a background job
            (``cmd &`` in a script).
        wrap: a command that runs the rest (``netns.py exec NAMESPACE``: on another "host").
    """

    def __init__(self, args: list[str], log_dir: Path, env: dict[str, str] | None = None,
                 module: str = "shardreplay", prefix: str = "", sigint_ignored: bool = False,
                 wrap: list[str] | None = None) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.args = list(args)
        self.stdout_path = log_dir / f"{prefix}stdout.txt"
        self.stderr_path = log_dir / f"{prefix}stderr.txt"
        self.seen: dict[int, tuple[float, str]] = {}  # pid -> (create time, command line)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.started_at = time.time()  # wall clock, to compare with the run's file times
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen([*(wrap or []), sys.executable, "-m", module, *args], stdout=out,
                                         stderr=err, start_new_session=True,
                                         env={**os.environ, **(env or {})},
                                         preexec_fn=_ignore_sigint if sigint_ignored else None)
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    # -- watching -------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._done.is_set():
            self._collect()
            time.sleep(0.1)

    def _collect(self) -> None:
        for pid in _descendant_pids(self.proc.pid):
            with contextlib.suppress(psutil.Error), self._lock:
                known = self.seen.get(pid)
                # A process seen between its fork and its exec shows its parent's command
                # line (or none): read it again while it is young.
                if known is None or time.time() - known[0] < _YOUNG_S:
                    c = psutil.Process(pid)
                    self.seen[pid] = (c.create_time(), " ".join(c.cmdline()))

    def descendants(self) -> list[psutil.Process]:
        """The live descendants now."""
        self._collect()
        with contextlib.suppress(psutil.Error):
            return psutil.Process(self.proc.pid).children(recursive=True)
        return []

    def children_of(self, pid: int) -> list[psutil.Process]:
        """Live started children of ``pid`` (learners or actors: not the multiprocessing
        resource tracker, nor a child still between fork and exec): spawned ones, and
        those forked from a fork server that ``pid`` started (the launcher's learners)."""
        found: list[psutil.Process] = []
        try:
            children = psutil.Process(pid).children()
        except psutil.Error:
            return found
        for c in children:
            with contextlib.suppress(psutil.Error):
                cmd = " ".join(c.cmdline())
                if "forkserver import main" in cmd:
                    found += [g for g in c.children() if g.status() != psutil.STATUS_ZOMBIE]
                elif "spawn_main" in cmd and c.status() != psutil.STATUS_ZOMBIE:
                    found.append(c)
        return found

    def learners(self) -> list[psutil.Process]:
        """The launcher's learner processes."""
        return self.children_of(self.proc.pid)

    def actors(self) -> list[psutil.Process]:
        """The actor processes (children of the learners)."""
        return [a for learner in self.learners() for a in self.children_of(learner.pid)]

    def leftovers(self, grace_s: float = 10.0) -> list[str]:
        """Descendants ever seen that are still alive (not zombies) after ``grace_s``."""
        deadline = time.monotonic() + grace_s
        while True:
            alive = []
            with self._lock:
                seen = dict(self.seen)
            for pid, (created, cmd) in seen.items():
                with contextlib.suppress(psutil.Error):
                    p = psutil.Process(pid)
                    if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                        alive.append(f"{pid}: {cmd[:120]}")
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)

    # -- driving --------------------------------------------------------------------------
    def ctrl_c(self) -> None:
        """SIGINT to the whole process group, as a terminal's Ctrl-C."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def terminate_launcher(self) -> None:
        """SIGTERM to the launcher only."""
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> int:
        """Exit code; raises ``subprocess.TimeoutExpired`` after ``timeout_s``."""
        return self.proc.wait(timeout=timeout_s)

    def wait_explained(self, timeout_s: float, what: str) -> int:
        """Exit code; past ``timeout_s`` an ``AssertionError`` naming ``what``, with both
        outputs and the Python stack of every process still running (where it hangs)."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{what}: still running after {timeout_s:g} s" + self.explain()
                                 + self.stacks()) from None

    def stacks(self) -> str:
        """``py-spy dump`` of each live process of the run (nothing where py-spy is absent)."""
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not os.access(spy, os.X_OK):
            return "\n(no py-spy: no stacks)"
        dumps = []
        for pid in [self.proc.pid, *_descendant_pids(self.proc.pid)]:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                                      timeout=20)
                dumps.append(f"--- py-spy dump {pid} ---\n{(done.stdout + done.stderr)[-4000:]}")
        return "\n" + "\n".join(dumps)

    def stdout(self) -> str:
        return self.stdout_path.read_text()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def summary(self) -> dict[str, Any]:
        """The run's summary: ``summary.json`` of the run directory (``--run-dir`` or
        ``--resume``) when ``shardreplay train`` ran, else the JSON an ``actor`` printed."""
        for flag in ("--run-dir", "--resume"):
            if flag in self.args:
                path = Path(self.args[self.args.index(flag) + 1]) / "summary.json"
                assert path.exists(), f"no {path}" + self.explain()
                return dict(json.loads(path.read_text()))
        decoder = json.JSONDecoder()
        text, found, at = self.stdout(), [], 0
        while (start := text.find("{", at)) >= 0:
            value, at = decoder.raw_decode(text, start)
            found.append(value)
        assert found, "no JSON summary on stdout" + self.explain()
        return next((v for v in found if v.get("rank") == 0), found[-1])

    def close(self) -> None:
        """Kill the process group and every descendant seen, reap the launcher."""
        self._collect()
        self._done.set()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with self._lock:
            seen = dict(self.seen)
        for pid, (created, _cmd) in seen.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.create_time() == created:
                    p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._watcher.join(timeout=5)

    def __enter__(self) -> TrainRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def explain(self) -> str:
        """The tail of both outputs, for assertion messages."""
        return f"\n--- stdout ---\n{self.stdout()[-3000:]}\n--- stderr ---\n{self.stderr()[-6000:]}"


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def metrics_rows(run_dir: Path) -> list[dict[str, str]]:
    """Rows of ``metrics.csv`` (empty before the first one)."""
    path = run_dir / "metrics.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def wait_until(predicate: Any, timeout_s: float, what: str, run: TrainRun | None = None,
               poll_s: float = 0.25) -> Any:
    """Poll ``predicate`` until true and return its value; fail with ``what`` (and the run's
    output) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if run is not None and run.proc.poll() is not None:
            raise AssertionError(f"the run exited ({run.proc.returncode}) while waiting for {what}"
                                 + run.explain())
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}"
                                 + (run.explain() if run is not None else ""))
        time.sleep(poll_s)
    return value


def training(run_dir: Path, min_updates: int = 1) -> bool:
    """True once metrics.csv shows environment steps and ``min_updates`` updates."""
    rows = metrics_rows(run_dir)
    # The last line may be read while the learner appends it: a row not yet whole counts as none.
    last = rows[-1] if rows else {}
    steps, updates = last.get("env_steps"), last.get("updates")
    if not steps or not updates or not steps.isdigit() or not updates.isdigit():
        return False
    return int(steps) > 0 and int(updates) >= min_updates


def newest_checkpoint(run_dir: Path) -> tuple[Path, checkpoint.Manifest]:
    """The newest checkpoint directory and its manifest (it must be complete)."""
    root = run_dir / "checkpoints"
    ids = checkpoint.list_checkpoints(root)
    assert ids, f"no checkpoint under {root}"
    directory = checkpoint.checkpoint_dir(root, ids[-1])
    assert checkpoint.is_complete(directory), f"{directory} is not complete: {sorted(os.listdir(directory))}"
    return directory, checkpoint.load_manifest(directory)


def manifest_steps(manifest: checkpoint.Manifest) -> int:
    """Steps stored in all parts of a checkpoint."""
    return sum(p.steps for p in manifest.parts)


def manifest_counters(manifest: checkpoint.Manifest) -> dict[str, int]:
    """The learner counters saved with a checkpoint (identical in every part's record)."""
    counters = [dict(r.counters) for r in learner_records(manifest)]
    assert all(c == counters[0] for c in counters), counters
    return counters[0]
