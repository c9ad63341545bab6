"""Helpers for runtime tests: chunks whose steps name their chunk, child processes that
always end, and a CartPole policy to publish.

Every chunk made here carries, in each of its steps, the field ``ident = (actor_id,
sequence)``: what a buffer holds then tells which chunks reached it and how often.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from shardreplay.runtime.envs import transition_spec
from shardreplay.spec import Field, Spec
from shardreplay.transport.codec import Chunk
from shardreplay.transport.redis import RedisTransport

# The actors' CartPole spec plus the identity of the chunk each step came in.
IDENT_SPEC = Spec({**transition_spec(4).fields, "ident": Field((2,), np.int64)})
CARTPOLE_SPEC = transition_spec(4)


def make_chunk(actor_id: int, sequence: int, *, s: int = 2, t: int = 4, version: int = 0,
               spec: Spec = IDENT_SPEC, obs_size: int = 4) -> Chunk:
    """A valid chunk; with ``IDENT_SPEC`` every step records ``(actor_id, sequence)``.

    Each stream holds one whole episode of ``t`` steps (FIRST ... LAST), so chunks can be
    written into a buffer in any order without touching each other's episodes.
    """
    rng = np.random.default_rng(actor_id * 1_000_003 + sequence)
    step_type = np.ones((s, t), np.uint8)
    step_type[:, 0] = 0
    step_type[:, -1] = 2
    steps: dict[str, np.ndarray] = {
        "obs": rng.standard_normal((s, t, obs_size)).astype(np.float32),
        "action": rng.integers(0, 2, (s, t)).astype(np.int64),
        "reward": np.ones((s, t), np.float32),
        "step_type": step_type,
        "discount": np.ones((s, t), np.float32),
    }
    if "ident" in spec:
        steps["ident"] = np.broadcast_to(np.array([actor_id, sequence], np.int64), (s, t, 2)).copy()
    return Chunk(actor_id=actor_id, sequence=sequence, policy_version=version,
                 stream_ids=np.arange(s, dtype=np.int64), steps=steps)


def ingest_record(ingestor: Any) -> dict[str, bytes]:
    """The learner record of a one-shard run holding ``ingestor``'s stored chunks, as
    ``checkpoint.save(files=...)`` takes it (what a learner rank saves beside its part)."""
    from shardreplay.runtime.policy_file import LearnerRecord, record_file

    return {record_file(0, 1): LearnerRecord({}, None, 0.0, None, ingestor.state_dict()).as_bytes()}


def ident_counts(idents: np.ndarray) -> Counter[tuple[int, int]]:
    """How many stored steps name each ``(actor_id, sequence)`` (``idents`` is ``[N, 2]``)."""
    return Counter(map(tuple, np.asarray(idents).reshape(-1, 2).tolist()))


class Children:
    """Child processes of a test: started here, always killed and reaped at ``close``.

    Tracks ``subprocess.Popen`` and ``multiprocessing`` processes, and every descendant
    ever seen of them, so a failing test leaves nothing behind.
    """

    def __init__(self) -> None:
        self._procs: list[Any] = []
        self._seen: dict[int, float] = {}

    def popen(self, args: list[str], log: Path, **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start ``args`` (stdout and stderr to ``log``) and track it."""
        with open(log, "wb") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, **kwargs)
        self._procs.append(proc)
        return proc

    def cli(self, args: list[str], log: Path, **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start ``python -m shardreplay <args>``."""
        return self.popen([sys.executable, "-m", "shardreplay", *args], log, **kwargs)

    def track(self, proc: Any) -> Any:
        """Track an already started process (a ``multiprocessing.Process``)."""
        self._procs.append(proc)
        return proc

    def note_descendants(self) -> None:
        """Remember the current descendants of every tracked process."""
        for proc in self._procs:
            with contextlib.suppress(psutil.Error, ValueError, TypeError):
                for c in psutil.Process(proc.pid).children(recursive=True):
                    self._seen.setdefault(c.pid, c.create_time())

    def close(self) -> None:
        """SIGKILL everything tracked and seen; reap."""
        self.note_descendants()
        for pid, created in self._seen.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.create_time() == created:
                    p.kill()
        for proc in self._procs:
            if isinstance(proc, subprocess.Popen):
                if proc.poll() is None:
                    proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
            else:
                with contextlib.suppress(ValueError, AssertionError):  # closed or not started
                    if proc.is_alive():
                        proc.kill()
                    proc.join(10)

    def alive(self) -> list[int]:
        """Pids of tracked or seen processes still running (zombies excluded)."""
        out = []
        pids = {p.pid: None for p in self._procs if p.pid is not None}
        pids.update(self._seen)
        for pid, created in pids.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if (created is None or p.create_time() == created) and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
        return out


@contextlib.contextmanager
def children() -> Iterator[Children]:
    """A :class:`Children` closed on exit."""
    kids = Children()
    try:
        yield kids
    finally:
        kids.close()


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.05,
             explain: Callable[[], str] | None = None) -> Any:
    """Poll ``predicate`` until it returns something true; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}"
                                 + (explain() if explain is not None else ""))
        time.sleep(poll_s)


def publish_cartpole_policy(url: str, version: int, hidden: tuple[int, ...] = (16,), seed: int = 0,
                            publisher: Any = None) -> Any:
    """Publish a small CartPole Q-network as ``version``; returns the publisher."""
    import torch

    from shardreplay.policy import open_publisher
    from shardreplay.runtime.algos.networks import QNetwork

    torch.manual_seed(seed + version)
    net = QNetwork(4, 2, hidden)
    publisher = publisher or open_publisher(url)
    publisher.publish(version, {k: v.detach() for k, v in net.state_dict().items()})
    return publisher


def kill9(pid: int) -> None:
    """SIGKILL ``pid`` (gone already is fine)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of a process (this one by default)."""
    return int(psutil.Process(pid or os.getpid()).memory_info().rss)


def redis_stream(shard: int, run_id: str = "") -> str:
    """The stream the Redis transport names for ``shard`` of ``run_id`` (no connection made)."""
    return RedisTransport("redis://127.0.0.1:1/0", CARTPOLE_SPEC).channel(shard, run_id)
