"""Chunks for transport tests: a small spec and a deterministic chunk maker."""

from __future__ import annotations

import time

import numpy as np

from shardreplay.spec import Field, Spec
from shardreplay.transport.codec import Chunk

SPEC = Spec({"obs": Field((4,), np.float32), "action": Field((), np.int64), "reward": Field((), np.float32)})


def make_chunk(actor_id: int = 0, sequence: int = 0, *, s: int = 2, t: int = 3, spec: Spec = SPEC,
               priorities: bool = False, seed: int | None = None) -> Chunk:
    """A valid chunk of ``spec`` whose values depend on ``(actor_id, sequence)``."""
    rng = np.random.default_rng(seed if seed is not None else actor_id * 100_003 + sequence)
    steps: dict[str, np.ndarray] = {}
    for name in spec.names:
        f = spec[name]
        shape = (s, t, *f.shape)
        if f.dtype.kind == "f":
            steps[name] = rng.standard_normal(shape).astype(f.dtype)
        elif f.dtype.kind == "b":
            steps[name] = rng.integers(0, 2, shape).astype(bool)
        else:
            info = np.iinfo(f.dtype)
            steps[name] = rng.integers(max(info.min, -1000), min(info.max, 1000), shape).astype(f.dtype)
    step_type = np.ones((s, t), np.uint8)
    step_type[:, 0] = 0
    step_type[:, -1] = 2
    steps["step_type"] = step_type
    steps["discount"] = rng.integers(0, 2, (s, t)).astype(np.float32)
    prio = rng.uniform(0.1, 5.0, (s, t)).astype(np.float32) if priorities else None
    return Chunk(actor_id=actor_id, sequence=sequence, policy_version=sequence // 2,
                 stream_ids=np.arange(s, dtype=np.int64) + 10 * actor_id, steps=steps, priorities=prio)


def assert_same_chunk(a: Chunk, b: Chunk) -> None:
    """Every id and array of two chunks is equal."""
    assert (a.actor_id, a.sequence, a.policy_version) == (b.actor_id, b.sequence, b.policy_version)
    np.testing.assert_array_equal(a.stream_ids, b.stream_ids)
    assert set(a.steps) == set(b.steps)
    for name in a.steps:
        np.testing.assert_array_equal(a.steps[name], b.steps[name], err_msg=name)
        assert a.steps[name].dtype == b.steps[name].dtype, name
    if a.priorities is None:
        assert b.priorities is None
    else:
        np.testing.assert_array_equal(a.priorities, b.priorities)


def send_chunks(transport, actor_id: int, count: int, timeout_s: float = 30.0) -> None:
    """Child-process body: send ``count`` chunks of ``actor_id`` through ``transport``."""
    writer = transport.writer()
    try:
        for seq in range(count):
            writer.send(make_chunk(actor_id, seq), timeout_s=timeout_s)
    finally:
        writer.close()


def receive_all(reader, expected: int, timeout_s: float = 30.0, ack: bool = True) -> list[Chunk]:
    """Receive until ``expected`` chunks arrived (acknowledging them) or time runs out."""
    import time

    out: list[Chunk] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < expected and time.monotonic() < deadline:
        got = reader.receive(64, timeout_s=0.2)
        if ack:
            reader.ack(got)
        out.extend(got)
    return out


def hold_ring_lock_forever(transport) -> None:
    """Child-process body: take the local ring's lock, as if killed mid-write, and hang."""
    import time

    transport._ring._acquire()
    time.sleep(600)


def fill_ring_forever(transport) -> None:
    """Child-process body: keep sending until killed (it ends up waiting for room)."""
    writer = transport.writer()
    seq = 0
    while True:
        writer.send(make_chunk(9, seq), timeout_s=None)
        seq += 1


def ring_record(writer: int, seq: int) -> bytes:
    """A record whose bytes all depend on (writer, seq), of a size that varies with them."""
    rng = np.random.default_rng(writer * 1_000_003 + seq)
    body = rng.integers(0, 256, int(rng.integers(1, 2000)), dtype=np.uint8).tobytes()
    return writer.to_bytes(2, "little") + seq.to_bytes(4, "little") + body


def put_ring_records(ring, writer: int, count: int) -> None:
    """Put ``count`` records of ``ring_record(writer, seq)`` into a ShmRing (spawned)."""
    for seq in range(count):
        if not ring.put(ring_record(writer, seq), time.monotonic() + 30):
            raise TimeoutError(f"writer {writer}: no room for 30 s")


def join_or_kill(procs, timeout_s: float = 30.0) -> None:
    """Join every process, killing those still alive after ``timeout_s`` (no orphans)."""
    for p in procs:
        p.join(timeout=timeout_s)
        if p.is_alive():
            p.kill()
            p.join()
