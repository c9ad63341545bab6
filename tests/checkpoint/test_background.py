"""Background saves: the checkpoint is the buffer at the call, however it is written meanwhile.

The writes that race the save overwrite the oldest rows (rings wrapped), so a save that
read the live slots late would hold the new steps; the forked writer's copy-on-write
memory keeps the old ones. Restored bit-exact (same layout: every array, position,
sampler and RNG state), in one process and on two gloo ranks; the part is byte for byte
the one ``save`` writes at the call; the writer is reaped whether it succeeds, fails or
is killed, and exits when its parent is killed (which leaves the previous checkpoint the
newest complete one).
"""

from __future__ import annotations

import errno
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

import shardreplay as sr
from shardreplay import checkpoint, testing
from shardreplay.checkpoint import saving
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.errors import CheckpointError
from tests.support import run_ranks

SPEC = sr.Spec({"obs": sr.Field((64,), np.float32), "ctr": sr.Field((), np.int64),
                "env": sr.Field((), np.int32, env_id=True), "home": sr.Field((), np.int32)})
STREAMS, CAPACITY = 4, 300


def _buffer(seed: int) -> sr.ReplayBuffer:
    return sr.ReplayBuffer(SPEC, num_streams=STREAMS, stream_capacity=CAPACITY, window=2,
                           sampler="prioritized", alpha=0.7, seed=seed)


def _snapshot(buf: sr.ReplayBuffer) -> dict[str, Any]:
    """Everything a faithful restore puts back, copied (the key epoch moves on by design)."""
    state = buf.state_dict()
    meta = {k: v for k, v in state["meta"].items() if k != "key_epoch"}
    arrays = {k: v.numpy().copy() for k, v in state["arrays"].items()}
    return {"meta": meta, "arrays": arrays, "counters": testing.sampler_counters(buf)}


def _assert_same(restored: dict[str, Any], saved: dict[str, Any]) -> None:
    assert restored["meta"] == saved["meta"]
    mass = saved["counters"].pop("mass")  # the rebuilt sum tree adds in another order
    assert restored["counters"].pop("mass") == pytest.approx(mass, rel=1e-5)
    assert restored["counters"] == saved["counters"]
    assert restored["arrays"].keys() == saved["arrays"].keys()
    for name, arr in saved["arrays"].items():
        np.testing.assert_array_equal(restored["arrays"][name], arr, err_msg=name)


def _chunk(rng: np.random.Generator, t: int, n: int = 25) -> dict[str, np.ndarray]:
    """``n`` steps of every row: random episodes (terminations, truncations), every step
    unique (``ctr``)."""
    types = rng.choice(np.array([0, 1, 2], np.uint8), size=(STREAMS, n), p=[0.1, 0.8, 0.1])
    return {"obs": rng.normal(size=(STREAMS, n, 64)).astype(np.float32),
            "ctr": t * 100 + np.arange(STREAMS * n, dtype=np.int64).reshape(STREAMS, n) * 10**6,
            "env": np.repeat(np.arange(STREAMS, dtype=np.int32)[:, None], n, 1),
            "home": rng.integers(0, 99, (STREAMS, n)).astype(np.int32), "step_type": types,
            "discount": np.where(types == 2, rng.choice([0.0, 1.0]), 1.0).astype(np.float32)}


def fill_random(buf: sr.ReplayBuffer, steps: int, *, seed: int, shard: int = 0) -> None:
    """``steps`` steps in every row with random priorities, then priority updates."""
    rng = np.random.default_rng([seed, shard])
    for t in range(0, steps, 25):
        buf.extend(_chunk(rng, t), priorities=rng.uniform(0.05, 3.0, (STREAMS, 25)).astype(np.float32))
    for _ in range(3):
        batch = buf.sample(16)
        buf.update_priorities(batch.keys, rng.uniform(0.0, 4.0, 16).astype(np.float32))


def _overwrite(buf: sr.ReplayBuffer, seed: int, steps: int = CAPACITY) -> None:
    """``steps`` more steps in every row, in chunks: the oldest rows are replaced."""
    rng = np.random.default_rng(seed)
    for t in range(0, steps, 25):
        buf.extend(_chunk(rng, -t))


class _Gate:
    """Holds a forked writer (after it set itself up, before it reads the buffer) until
    released: writes made meanwhile land before the writer reads anything."""

    def __init__(self) -> None:
        self._go_r, self._go_w = os.pipe()
        self._at_r, self._at_w = os.pipe()
        self._test = os.getpid()
        self.held = False
        self._real = saving._content

    def content(self, job: Any) -> Any:
        if self.held and os.getpid() != self._test:  # in the writer
            os.write(self._at_w, b"a")
            os.read(self._go_r, 1)
        return self._real(job)

    def hold(self) -> None:
        self.held = True

    def arrived(self) -> None:
        """Wait until the writer is at the gate (its signal handlers are in place)."""
        assert os.read(self._at_r, 1) == b"a"

    def release(self) -> None:
        if self.held:
            os.write(self._go_w, b"x")
            self.held = False

    def close(self) -> None:
        for fd in (self._go_r, self._go_w, self._at_r, self._at_w):
            os.close(fd)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Gate]:
    g = _Gate()
    monkeypatch.setattr(saving, "_content", g.content)
    yield g
    g.close()


def _assert_reaped(pending: checkpoint.PendingSave) -> None:
    """The writer of ``pending`` ran and was reaped (it is no child of this process any more)."""
    assert pending.pid is not None and pending.done()
    with pytest.raises(ChildProcessError):
        os.waitpid(pending.pid, os.WNOHANG)


def test_background_part_is_byte_for_byte_the_part_save_writes_at_the_call(tmp_path: Path,
                                                                            gate: _Gate) -> None:
    buf = _buffer(0)
    fill_random(buf, CAPACITY + 120, seed=7)  # rings wrapped
    sync = checkpoint.save(buf, tmp_path / "sync", 1, files={"at": b"1"})
    gate.hold()
    pending = checkpoint.save_in_background(buf, tmp_path / "bg", 1, files={"at": b"1"})
    _overwrite(buf, seed=8)  # every saved step replaced before the writer reads any
    gate.release()
    background = pending.wait(60)
    _assert_reaped(pending)
    part = "part-00000-of-00001.safetensors"
    assert (background / part).read_bytes() == (sync / part).read_bytes()
    assert (background / "at").read_bytes() == b"1"
    assert checkpoint.is_complete(background, hashes=True)


def test_a_failed_background_write_raises_and_its_writer_is_reaped(tmp_path: Path) -> None:
    buf = _buffer(0)
    fill_random(buf, 100, seed=9)
    checkpoint.save(buf, tmp_path, 1, incremental=True)
    checkpoint.checkpoint_dir(tmp_path, 2).write_bytes(b"a file where the directory goes")
    pending = checkpoint.save_in_background(buf, tmp_path, 2, incremental=True)
    with pytest.raises(CheckpointError, match="cannot write checkpoint") as failed:
        pending.wait(60)
    _assert_reaped(pending)
    # The OSError behind it comes back too (a full disk is told apart by it: _io.storage_error).
    cause = failed.value.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.EEXIST
    assert checkpoint.latest_complete(tmp_path) == 1
    checkpoint.save_in_background(buf, tmp_path, 3, incremental=True).wait(60)  # the shard is free again
    assert checkpoint.latest_complete(tmp_path) == 3


def test_the_writer_ignores_stop_signals_and_a_killed_one_is_reaped(tmp_path: Path, gate: _Gate) -> None:
    buf = _buffer(0)
    fill_random(buf, 100, seed=11)
    checkpoint.save(buf, tmp_path, 1)
    gate.hold()
    pending = checkpoint.save_in_background(buf, tmp_path, 2)
    gate.arrived()
    assert pending.pid is not None
    for sig in (signal.SIGINT, signal.SIGTERM):  # the caller decides when to stop, not its writer
        os.kill(pending.pid, sig)
    gate.release()
    pending.wait(60)
    _assert_reaped(pending)
    gate.hold()
    killed = checkpoint.save_in_background(buf, tmp_path, 3)
    gate.arrived()
    assert killed.pid is not None
    os.kill(killed.pid, signal.SIGKILL)
    with pytest.raises(CheckpointError, match="killed by signal 9"):
        killed.wait(60)
    _assert_reaped(killed)
    gate.held = False  # the killed writer took no byte
    assert checkpoint.latest_complete(tmp_path) == 2
    checkpoint.save_in_background(buf, tmp_path, 4).wait(60)  # the shard is free again
    assert checkpoint.latest_complete(tmp_path) == 4


def _huge_kb(arr: np.ndarray, flags: set[str] | None = None) -> int:
    """AnonHugePages of the mappings that hold ``arr`` (kB); their VmFlags go to ``flags``."""
    total, inside, start = 0, False, arr.ctypes.data
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < start + arr.nbytes and start < hi
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
            elif inside and head == "VmFlags:" and flags is not None:
                flags.update(line.split()[1:])
    return total


def _needs_collapse() -> None:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    release = tuple(int(x) for x in platform.release().split(".")[:2] if x.isdigit())
    if not thp.exists() or "[never]" in thp.read_text() or release < (6, 1):
        pytest.skip("needs transparent huge pages and MADV_COLLAPSE (Linux >= 6.1)")


def test_a_background_save_puts_the_shard_back_on_huge_pages(tmp_path: Path, gate: _Gate) -> None:
    """The writes made during a save split each shared huge page they hit (copy on write);
    the next fork would copy a page-table entry per 4 KiB page. After the save they are
    huge pages again."""
    _needs_collapse()
    spec = sr.Spec({"obs": sr.Field((4096,), np.uint8)})
    buf, restored = (sr.ReplayBuffer(spec, num_streams=2, stream_capacity=4096, window=1) for _ in range(2))
    mid = np.ones((2, 4096), np.uint8)  # MID steps
    buf.extend({"obs": np.ones((2, 4096, 4096), np.uint8), "step_type": mid})
    obs = testing.shard(buf).fields["obs"]
    before = _huge_kb(obs)
    if before < 16 << 10:
        pytest.skip(f"the kernel gave the 32 MiB array {before} kB of huge pages")
    gate.hold()
    pending = checkpoint.save_in_background(buf, tmp_path, 1)
    gate.arrived()
    buf.extend({"obs": np.full((2, 4096, 4096), 2, np.uint8), "step_type": mid})
    split = _huge_kb(obs)
    gate.release()
    pending.wait(60)
    assert split < before // 4
    assert _huge_kb(obs) >= before - 2 * 2048  # but for a huge page across either end of it
    checkpoint.load(tmp_path, restored)
    assert (np.asarray(restored.sample(8).data["obs"]) == 1).all()  # the buffer at the call


def test_a_background_save_puts_written_frame_rings_on_huge_pages(tmp_path: Path) -> None:
    """Frame rings are written on 4 KiB pages (a 2 MiB fault inside an add is too long), so a
    fork copied a page-table entry per 4 KiB of them (51 ms of CPU for a 2 GB shard). After
    a save their written frames are on huge pages, and a new fault there is still 4 KiB."""
    _needs_collapse()
    spec = sr.Spec({"obs": sr.Field((4, 64, 64), np.uint8, frame_stack=True)})
    buf, restored = (sr.ReplayBuffer(spec, num_streams=2, stream_capacity=2048, window=1) for _ in range(2))
    frames = np.random.default_rng(0).integers(0, 255, (2, 2048 + 3, 64, 64), np.uint8)
    stacks = np.lib.stride_tricks.sliding_window_view(frames, 4, axis=1).transpose(0, 1, 4, 2, 3)
    buf.extend({"obs": stacks, "step_type": np.ones((2, 2048), np.uint8)})  # MID steps
    rings = testing.shard(buf)._storage.stacked["obs"].written()
    assert [ring.nbytes for ring in rings] == [(2048 + 3) * 4096] * 2  # 8 MiB each
    assert sum(_huge_kb(ring) for ring in rings) == 0
    checkpoint.save_in_background(buf, tmp_path, 1).wait(60)
    flags: set[str] = set()
    assert sum(_huge_kb(ring, flags) for ring in rings) >= 2 * (8 << 10) - 4 * 2048  # but the ends' pages
    assert "nh" in flags and "hg" not in flags  # faults there: 4 KiB pages, as before
    checkpoint.load(tmp_path, restored)
    saved, back = (b.state_dict()["arrays"]["field.obs"] for b in (buf, restored))
    assert np.array_equal(back, saved)


@pytest.mark.slow  # ~11 s on 2 busy cores (compiled kernels of a first write included)
def test_background_save_racing_overwrites_restores_the_buffer_at_the_call(tmp_path: Path) -> None:
    buf = _buffer(0)
    fill_random(buf, CAPACITY + 120, seed=1)  # rings wrapped: a row is written in two pieces
    saved = _snapshot(buf)
    pending = checkpoint.save_in_background(buf, tmp_path, 1, files={"at": b"1"})
    _overwrite(buf, seed=2)  # every saved step is replaced while the child writes
    assert pending.wait(60) == checkpoint.checkpoint_dir(tmp_path, 1)
    _assert_reaped(pending)
    restored = _buffer(5)
    report = checkpoint.load(tmp_path, restored, files=("at",))
    assert report.exact and report.files == {"at": b"1"}
    _assert_same(_snapshot(restored), saved)
    # The buffer went on: a second save (the first one is finished) holds the new rows.
    checkpoint.save_in_background(buf, tmp_path, 2).wait(60)
    again = _buffer(6)
    checkpoint.load(tmp_path, again)
    _assert_same(_snapshot(again), _snapshot(buf))


def test_saves_of_one_shard_never_overlap(tmp_path: Path) -> None:
    buf = _buffer(0)
    fill_random(buf, 200, seed=3)
    first = checkpoint.save_in_background(buf, tmp_path, 1)
    at_second = _snapshot(buf)
    second = checkpoint.save_in_background(buf, tmp_path, 2)  # waits until the first is written
    # The first one's part and manifest are in place (its thread may not have returned yet).
    assert (first.directory / "manifest.json").exists()
    first.wait(60)
    _overwrite(buf, seed=4)
    second.wait(60)
    restored = _buffer(1)
    checkpoint.load(tmp_path, restored, checkpoint_id=2)
    _assert_same(_snapshot(restored), at_second)


def _rank_saves_in_background(rank: int, world: int, root: str) -> dict[str, Any]:
    local = _buffer(rank)
    fill_random(local, CAPACITY + 60 + 30 * rank, shard=rank, seed=10 + rank)
    buf = ShardedReplayBuffer(local, timeout_s=60)
    saved = _snapshot(local)
    pending = checkpoint.save_in_background(buf, root, 4)
    _overwrite(local, seed=20 + rank)
    pending.wait(60)
    dist.barrier()  # the other rank's part is written too
    fresh = ShardedReplayBuffer(_buffer(30 + rank), timeout_s=60)
    report = checkpoint.load(root, fresh)
    return {"saved": saved, "restored": _snapshot(fresh.local), "exact": report.exact}


@pytest.mark.distributed
@pytest.mark.slow  # one launch of two gloo ranks (~15 s)
def test_gloo_background_saves_restore_each_shard_as_at_the_call(tmp_path: Path) -> None:
    results = run_ranks(_rank_saves_in_background, 2, str(tmp_path))
    for r in results:
        assert r["exact"]
        _assert_same(r["restored"], r["saved"])


_CHILD = r"""
import contextlib, os, sys, time
import numpy as np
import shardreplay as sr
from shardreplay import checkpoint
from shardreplay.checkpoint import format as fmt

root = sys.argv[1]
spec = sr.Spec({"obs": sr.Field((4096,), np.uint8)})
buf = sr.ReplayBuffer(spec, num_streams=8, stream_capacity=3000, window=1, sampler="uniform", seed=0)
chunk = {"obs": np.full((8, 100, 4096), 7, np.uint8), "step_type": np.ones((8, 100), np.uint8)}
for _ in range(30):
    buf.extend(chunk)
checkpoint.save(buf, root, 1)
real_writer = fmt.atomic_writer


parent = os.getpid()


class Held:
    # The writer's part file: its header and first block are written, then the writer
    # waits (for its parent's SIGKILL) in the middle of the part, whatever the disk's speed.
    def __init__(self, f):
        self.f, self.writes = f, 0

    def write(self, data):
        self.writes += 1
        if self.writes == 4:
            self.f.flush()
            os.write(1, f"writing {os.getpid()}\n".encode())
            time.sleep(600)
        return self.f.write(data)


@contextlib.contextmanager
def held_writer(path, **kwargs):
    with real_writer(path, **kwargs) as f:
        yield Held(f) if os.getpid() != parent else f  # the forked writer only


fmt.atomic_writer = held_writer
pending = checkpoint.save_in_background(buf, root, 2)
for _ in range(3):  # writes go on meanwhile
    buf.extend(chunk)
time.sleep(600)
"""


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie its new parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.slow  # writes ~200 MB (a few seconds on a busy disk)
def test_sigkill_during_a_background_write_leaves_the_previous_checkpoint_newest(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        assert child.stdout is not None
        word, writer = child.stdout.readline().split()
        assert word == "writing"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(30)
    # The orphaned writer notices its parent is gone and exits (polled: no time asserted).
    deadline = time.monotonic() + 120
    while not _ended(int(writer)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ended(int(writer)), "the writer outlived its parent"
    second = checkpoint.checkpoint_dir(tmp_path, 2)
    assert [p for p in second.iterdir() if p.name.endswith(".tmp")], "not killed mid-write"
    assert not checkpoint.is_complete(second)
    assert checkpoint.latest_complete(tmp_path) == 1
    spec = sr.Spec({"obs": sr.Field((4096,), np.uint8)})
    buf = sr.ReplayBuffer(spec, num_streams=8, stream_capacity=3000, window=1, sampler="uniform")
    report = checkpoint.load(tmp_path, buf)
    assert report.checkpoint_id == 1 and report.steps == 8 * 3000
    assert report.skipped and report.skipped[0].startswith("2:")


# -- frame-stacked fields: the frame rings are fenced too ----------------------------------
K, FRAME = 4, (6, 7)
STACKED = sr.Spec({"obs": sr.Field((K, *FRAME), np.uint8, frame_stack=True), "ctr": sr.Field((), np.int64)})


def _stacked_buffer(seed: int) -> sr.ReplayBuffer:
    return sr.ReplayBuffer(STACKED, num_streams=STREAMS, stream_capacity=CAPACITY, window=2,
                           sampler="prioritized", alpha=0.7, seed=seed)


class _Frames:
    """Stacks of every stream that shift one new random frame in per step (a reset stack
    repeats its first frame); ``p_done`` ends episodes (short ones store more frames)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.stack = np.zeros((STREAMS, K, *FRAME), np.uint8)
        self.ended = np.ones(STREAMS, bool)
        self.t = 0

    def chunk(self, n: int, p_done: float) -> dict[str, np.ndarray]:
        obs = np.empty((STREAMS, n, K, *FRAME), np.uint8)
        types = np.empty((STREAMS, n), np.uint8)
        for t in range(n):
            frame = self.rng.integers(0, 256, (STREAMS, *FRAME), dtype=np.uint8)
            done = self.rng.random(STREAMS) < p_done
            types[:, t] = np.where(self.ended, 0, np.where(done, 2, 1))
            shifted = np.concatenate([self.stack[:, 1:], frame[:, None]], axis=1)
            self.stack = np.where(self.ended[:, None, None, None], frame[:, None], shifted)
            obs[:, t] = self.stack
            self.ended = types[:, t] == 2
        self.t += n
        ctr = self.t * 1000 + np.arange(STREAMS * n, dtype=np.int64).reshape(STREAMS, n)
        return {"obs": obs, "ctr": ctr, "step_type": types,
                "discount": np.where(types == 2, 0.0, 1.0).astype(np.float32)}


def _fill_stacked(buf: sr.ReplayBuffer, env: _Frames, steps: int, p_done: float) -> None:
    for _ in range(0, steps, 25):
        prios = env.rng.uniform(0.1, 2.0, (STREAMS, 25)).astype(np.float32)
        buf.extend(env.chunk(25, p_done), priorities=prios)


@pytest.mark.parametrize("when", ["before_the_write", "racing_the_write"])
def test_frame_stacked_background_save_restores_the_buffer_at_the_call(tmp_path: Path, when: str,
                                                                         gate: _Gate) -> None:
    """Writes after the call overwrite the oldest frames (short episodes: reset stacks of K
    frames, so the rings also grow); the checkpoint still holds the stacks at the call."""
    buf, env = _stacked_buffer(0), _Frames(1)
    _fill_stacked(buf, env, CAPACITY + 100, p_done=0.02)  # rings wrapped
    saved = _snapshot(buf)
    frames = testing.shard(buf)._storage.stacked["obs"]
    ring = frames.frame_capacity
    if when == "before_the_write":  # deterministic: every overwrite lands before the writer reads
        gate.hold()
    pending = checkpoint.save_in_background(buf, tmp_path, 1)
    _fill_stacked(buf, env, CAPACITY, p_done=0.3)
    assert frames.frame_capacity > ring  # the ring grew meanwhile
    gate.release()
    pending.wait(60)
    _assert_reaped(pending)
    restored = _stacked_buffer(5)
    assert checkpoint.load(tmp_path, restored).exact
    _assert_same(_snapshot(restored), saved)
