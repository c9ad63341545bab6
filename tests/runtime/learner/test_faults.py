"""Faults with real processes, a real redis-server and hard timeouts; no process is left.

- An actor killed (SIGKILL) in the middle of writing a chunk: nothing partial is ever
  ingested (spool: its temp file is never read; Redis: an entry is atomic; local: the
  ring's lock is recovered) and ingestion goes on.
- A learner killed and restarted, again and again: every chunk ends up exactly once in
  the buffer that survives. "Exactly once" here is at-least-once delivery (a chunk
  stays in the medium until acknowledged) + per-actor high-water marks saved in each
  checkpoint (a chunk re-delivered after the checkpoint that holds it is dropped) +
  acknowledging only after the checkpoint (save, then ack). See ``runtime/learner/ingest.py``.
- Corrupt or truncated chunks: quarantined (spool) or rejected (Redis, local), counted,
  and the chunks after them still arrive.
- Forged headers (another spec, absurd sizes): rejected without allocating what they
  claim (peak RSS of the reader process measured).

Redis restarted under a running ``shardreplay train`` is in ``test_train_faults.py``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import struct
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from shardreplay import checkpoint
from shardreplay._hashing import xxh3_64
from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.runtime.learner.ingest import Ingestor
from shardreplay.runtime.settings import TrainSettings
from shardreplay.spec import Field, Spec
from shardreplay.transport import open_transport
from shardreplay.transport.codec import _PREFIX, FORMAT_VERSION, MAGIC, _layout, encode
from shardreplay.transport.spool import chunk_file_name
from tests.runtime.fault_children import big_spec, read_forged, reader_life, write_forever
from tests.runtime.runtime_helpers import IDENT_SPEC, children, ident_counts, kill9, make_chunk, wait_for

# Forked children start at once (a spawned one spends seconds importing on a loaded
# machine); their bodies use no torch operation, so the parent's threads do not matter.
CTX = mp.get_context("fork")
START_S = 60.0
BIG_OBS, BIG_S, BIG_T = 32768, 4, 16  # 8 MiB chunks: a write takes long enough to be hit


def _transport(kind: str, tmp_path: Path, redis_factory: Any, spec: Spec = IDENT_SPEC, **options: Any) -> Any:
    if kind == "file":
        return open_transport(f"file://{tmp_path}/spool", spec, **options)
    if kind == "redis":
        return open_transport(redis_factory().url, spec, **options)
    return open_transport("local", spec, capacity_bytes=96 << 20, **options)


def _start(kids: Any, target: Any, *args: Any) -> Any:
    proc = CTX.Process(target=target, args=args, daemon=True)
    proc.start()
    return kids.track(proc)


def _ingestor(transport: Any, spec: Spec, num_actors: int, capacity: int = 256) -> Ingestor:
    envs = BIG_S if spec is not IDENT_SPEC else 2
    settings = TrainSettings.from_dict(dict(learners=1, actors=num_actors, envs_per_actor=envs,
                                            transport="file:///unused"))
    streams = settings.streams.streams_of_shard(0)
    return Ingestor(transport.reader(), ReplayBuffer(spec, num_streams=streams, stream_capacity=capacity,
                                                     window=2), settings)


# -- an actor killed mid-write ------------------------------------------------------------
def _kill_mid_write(kind: str, transport: Any, proc: Any, tmp_path: Path, redis_url: str | None) -> bool:
    """SIGKILL ``proc`` while it writes a chunk, as far as the medium lets us see it;
    returns whether the kill is known to have landed mid-write."""
    if kind == "file":  # a temp file exists from open to rename
        tmp = tmp_path / "spool" / "tmp"
        wait_for(lambda: any(tmp.iterdir()), START_S, "a chunk being written", poll_s=0.001)
        kill9(proc.pid)
        proc.join(10)
        return any(tmp.iterdir())
    if kind == "local":  # the writer holds the ring's lock while it copies a record in
        meta = transport._ring._meta
        wait_for(lambda: meta[2] == proc.pid, START_S, "the writer to hold the ring lock", poll_s=0.0005)
        kill9(proc.pid)
        proc.join(10)
        return True
    import redis

    client = redis.Redis.from_url(redis_url)
    wait_for(lambda: client.xlen(transport.stream) >= 1, START_S, "a first chunk")
    time.sleep(np.random.default_rng(proc.pid).uniform(0, 0.2))
    kill9(proc.pid)
    proc.join(10)
    client.close()
    return False


def _half_sent_xadd(url: str, stream: str, data: bytes) -> None:
    """Send the first half of an XADD command over a raw socket, then vanish."""
    from urllib.parse import urlparse

    u = urlparse(url)
    parts = [b"XADD", stream.encode(), b"*", b"d", data]
    command = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
    with socket.create_connection((u.hostname, u.port)) as s:
        s.sendall(command[:len(command) // 2])
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # reset, no FIN


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["file", "local", pytest.param("redis", marks=pytest.mark.redis)])
def test_actor_killed_mid_write_leaves_nothing_partial(tmp_path: Path, kind: str, redis_factory) -> None:
    spec = big_spec(BIG_OBS)
    options = {"max_chunk_bytes": 64 << 20}
    if kind == "redis":
        options["max_len"] = 8
    transport = _transport(kind, tmp_path, redis_factory, spec, **options)
    redis_url = transport.url if kind == "redis" else None
    ingestor = _ingestor(transport, spec, num_actors=4, capacity=4096)
    got: list[Any] = []

    def drain() -> None:
        got.extend(ingestor.reader.receive(8, timeout_s=0.05))
        ingestor.reader.ack(got[-8:])

    landed = []
    with children() as kids:
        for life in range(3):  # three lives of actor 1, each killed while writing
            proc = _start(kids, write_forever, transport, 1, 1000 * life, BIG_OBS, BIG_S, BIG_T)
            landed.append(_kill_mid_write(kind, transport, proc, tmp_path, redis_url))
            drain()
        if kind == "redis":
            lost = make_chunk(1, 9999, s=BIG_S, t=BIG_T, spec=spec, obs_size=BIG_OBS)
            _half_sent_xadd(redis_url, transport.stream, encode(lost, spec))
        # Ingestion goes on: a healthy actor's chunks all arrive after the dead ones'.
        healthy = _start(kids, write_n_big, transport, 2, 5)
        before = len(got)
        wait_for(lambda: (drain(), sum(c.actor_id == 2 for c in got[before:]) >= 5)[1], START_S,
                 "the healthy actor's chunks")
        healthy.join(30)
        assert healthy.exitcode == 0
        drain()
    assert kids.alive() == []
    if kind == "file":
        assert any(landed), "no kill landed while a temp file existed"
    stats = ingestor.reader.stats
    assert stats.total_rejected == 0, stats  # nothing partial was ever read
    for c in got:  # every chunk delivered is whole and holds what its actor wrote
        expect = make_chunk(c.actor_id, c.sequence, s=BIG_S, t=BIG_T, spec=spec, obs_size=BIG_OBS)
        np.testing.assert_array_equal(c.steps["obs"], expect.steps["obs"])
    for life in range(3):  # each life: a gap-free prefix of what it wrote
        seqs = sorted(c.sequence - 1000 * life for c in got if c.actor_id == 1 and c.sequence // 1000 == life)
        assert seqs == list(range(len(seqs)))
    assert sorted(c.sequence for c in got if c.actor_id == 2) == list(range(5))
    assert all(c.sequence != 9999 for c in got)
    for c in got:
        assert ingestor._write(c, 0) == BIG_S * BIG_T  # and all of it can be stored


def write_n_big(transport: Any, actor_id: int, count: int) -> None:
    """Child body: ``count`` 8 MiB chunks of ``actor_id``."""
    spec = big_spec(BIG_OBS)
    writer = transport.writer()
    for seq in range(count):
        writer.send(make_chunk(actor_id, seq, s=BIG_S, t=BIG_T, spec=spec, obs_size=BIG_OBS), timeout_s=120)
    writer.close()


# -- a learner killed and restarted ---------------------------------------------------------
def _life(kids: Any, transport: Any, root: Path, lives: Path, k: int, die_after_save: bool,
          num_actors: int, capacity: int) -> tuple[Any, Path]:
    life_file = lives / f"life-{k}.json"
    proc = _start(kids, reader_life, transport, str(root), num_actors, capacity, str(life_file),
                  die_after_save)
    return proc, life_file


def _progress(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["file", pytest.param("redis", marks=pytest.mark.redis)])
def test_learner_killed_and_restarted_stores_every_chunk_exactly_once(tmp_path: Path, kind: str,
                                                                      redis_factory) -> None:
    num_actors, batch, lives_n, steps_per_chunk = 3, 8, 6, 2 * 4
    per_actor = batch * lives_n
    total = num_actors * per_actor * steps_per_chunk
    options = {"fsync": False} if kind == "file" else {"consumer": "learner-0"}
    transport = _transport(kind, tmp_path, redis_factory, **options)
    writer = transport.writer()  # the actors: each life finds a new batch of their chunks

    def write_batch(k: int) -> None:
        for q in range(k * batch, (k + 1) * batch):
            for a in range(num_actors):
                writer.send(make_chunk(a, q), timeout_s=30)

    root, lives = tmp_path / "ckpt", tmp_path / "lives"
    lives.mkdir()
    rng = np.random.default_rng(7)
    files = []
    with children() as kids:
        # Life 0 dies right after its first save, before acknowledging: everything it
        # saved is delivered again to life 1, which must drop it.
        write_batch(0)
        proc, life_file = _life(kids, transport, root, lives, 0, True, num_actors, 256)
        files.append(life_file)
        proc.join(START_S)
        assert proc.exitcode == -9 and _progress(life_file)["saves"] == 0  # died inside the window
        for k in range(1, lives_n):  # lives killed at a random point of their loop
            write_batch(k)
            proc, life_file = _life(kids, transport, root, lives, k, False, num_actors, 256)
            files.append(life_file)
            wait_for(lambda f=life_file: _progress(f).get("saves", 0) >= 1, START_S, f"life {k} to save")
            time.sleep(rng.uniform(0.0, 0.2))
            kill9(proc.pid)
            proc.join(10)
        proc, last = _life(kids, transport, root, lives, lives_n, False, num_actors, 256)
        files.append(last)
        # Storing every step is not the end: chunks an earlier life saved but was killed
        # before acknowledging may still be in ready/ (a life that restored all of them
        # says so before its first receive); the last life drops them, saves, acknowledges.
        ready = tmp_path / "spool" / "ready"

        def done() -> bool:
            return _progress(last).get("steps", 0) >= total and (kind != "file" or not any(ready.iterdir()))

        wait_for(done, START_S, "the last life to store everything and acknowledge every chunk",
                 explain=lambda: f" {[_progress(f) for f in files]}, ready/: {sorted(ready.glob('*'))}")
        kill9(proc.pid)
        proc.join(10)
    writer.close()
    buffer = ReplayBuffer(IDENT_SPEC, num_streams=2 * num_actors, stream_capacity=256, window=2)
    checkpoint.load(root, buffer)
    counts = ident_counts(buffer.state_dict()["arrays"]["field.ident"])
    expected = {(a, q): steps_per_chunk for a in range(num_actors) for q in range(per_actor)}
    assert {k: n for k, n in counts.items() if n != steps_per_chunk} == {}  # none twice
    assert counts == expected  # every chunk, each exactly once
    lives_seen = [_progress(f) for f in files]
    assert lives_seen[1]["duplicates"] >= 1, lives_seen  # the re-delivered chunks were dropped
    assert all(life["restored"] is not None for life in lives_seen[1:]), lives_seen
    if kind == "file":
        assert not any(ready.iterdir())  # all acknowledged in the end


# -- corrupt and truncated chunks -----------------------------------------------------------
def _inject(kind: str, transport: Any, tmp_path: Path, name: str, data: bytes) -> None:
    """Put raw bytes where a writer would have put a chunk."""
    if kind == "file":
        (tmp_path / "spool" / "ready" / name).write_bytes(data)
    elif kind == "redis":
        import redis

        client = redis.Redis.from_url(transport.url)
        client.xadd(transport.stream, {b"d": data})
        client.close()
    else:
        assert transport._ring.put(data, None)


@pytest.mark.parametrize("kind", ["file", "local", pytest.param("redis", marks=pytest.mark.redis)])
def test_corrupt_and_truncated_chunks_are_set_aside_and_ingest_goes_on(tmp_path: Path, kind: str,
                                                                       redis_factory) -> None:
    transport = _transport(kind, tmp_path, redis_factory)
    writer = transport.writer()
    ingestor = _ingestor(transport, IDENT_SPEC, num_actors=1)
    writer.send(make_chunk(0, 0))
    good = encode(make_chunk(0, 1), IDENT_SPEC)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x10
    _inject(kind, transport, tmp_path, chunk_file_name(0, 1), bytes(flipped))
    _inject(kind, transport, tmp_path, chunk_file_name(0, 2), good[:len(good) - 100])
    _inject(kind, transport, tmp_path, chunk_file_name(0, 3), b"not a chunk at all; " * 4)
    writer.send(make_chunk(0, 4))
    got = 0
    deadline = time.monotonic() + 20
    while got < 16 and time.monotonic() < deadline:
        got += ingestor.drain(8, 0.1, 0)
    writer.send(make_chunk(0, 5))  # and later ones still come
    while got < 24 and time.monotonic() < deadline:
        got += ingestor.drain(8, 0.1, 0)
    assert got == 24
    stored = ident_counts(ingestor.buffer.state_dict()["arrays"]["field.ident"])
    assert stored == {(0, 0): 8, (0, 4): 8, (0, 5): 8}
    assert ingestor.reader.stats.rejected == {"checksum": 1, "truncated": 1, "format": 1}
    if kind == "file":
        quarantine = sorted(p.name for p in (tmp_path / "spool" / "quarantine").iterdir())
        assert quarantine == sorted([chunk_file_name(0, q) for q in (1, 2, 3)]
                                    + [chunk_file_name(0, q) + ".reason" for q in (1, 2, 3)])
        reason = tmp_path / "spool" / "quarantine" / (chunk_file_name(0, 1) + ".reason")
        assert reason.read_text() == "checksum\n"
    if kind == "redis":
        import redis

        client = redis.Redis.from_url(transport.url)
        ingestor.reader.receive(1, timeout_s=0.05)  # carries the queued acknowledgements
        assert client.xpending(transport.stream, transport.group)["pending"] == 0  # rejected: never again
        client.close()
    writer.close()
    ingestor.close()


# -- forged headers -----------------------------------------------------------------------
def _forge(header: dict[str, Any] | bytes, payload: bytes = b"", *, total: int | None = None,
           hlen: int | None = None, actor: int = 0) -> bytes:
    """A chunk with any header, payload and actor id, and a correct checksum (an actor that lies)."""
    head = header if isinstance(header, bytes) else msgpack.packb(header)
    pad = bytes(-(_PREFIX.size + len(head)) % 8)
    body = head + pad + payload
    total = _PREFIX.size + len(body) if total is None else total
    data = bytearray(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(head) if hlen is None else hlen, total, 0,
                                  actor, 1, 0) + body)
    data[24:32] = xxh3_64(memoryview(data)[32:]).to_bytes(8, "little")
    return bytes(data)


def _forgeries() -> dict[str, tuple[bytes, str]]:
    """name -> (bytes, the reason the reader must give)."""
    good = encode(make_chunk(0, 1), IDENT_SPEC)
    head = msgpack.unpackb(good[_PREFIX.size:_PREFIX.size + _PREFIX.unpack_from(good)[2]])
    payload = good[(_PREFIX.size + _PREFIX.unpack_from(good)[2] + 7) // 8 * 8:]
    huge = 1 << 24
    lying = {**head, "S": huge, "T": huge}
    lying["arrays"] = [[n, d, [huge] * len(s), o, 10 ** 12] for n, d, s, o, _ in head["arrays"]]
    exact = {**head, "S": huge, "T": huge, "arrays": _layout(IDENT_SPEC, huge, huge, False).entries}
    other = Spec({**IDENT_SPEC.fields, "obs": Field((400_000,), np.float32)})
    return {
        "total 1e12": (good[:12] + struct.pack("<Q", 10 ** 12) + good[20:], "truncated"),
        "header 4 GiB": (_forge(good[_PREFIX.size:], hlen=(1 << 32) - 1), "header"),
        "arrays of 1e12 bytes": (_forge(lying), "header"),
        "S=T=2^24, no payload": (_forge(exact), "header"),
        "msgpack array of 2^32": (_forge(b"\xdd\xff\xff\xff\xff"), "header"),
        "msgpack str of 1 GiB": (_forge(b"\xdb\x3f\xff\xff\xff"), "header"),
        "half the payload": (_forge(head, bytes(4096)), "header"),
        "negative actor": (_forge(head, payload, actor=2**64 - 1), "header"),
        "another spec": (encode(make_chunk(0, 1, s=1, t=1, spec=other, obs_size=400_000), other), "spec"),
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["file", "local", pytest.param("redis", marks=pytest.mark.redis)])
def test_forged_headers_are_rejected_without_allocating_their_claims(tmp_path: Path, kind: str,
                                                                     redis_factory) -> None:
    transport = _transport(kind, tmp_path, redis_factory)
    writer = transport.writer()
    writer.send(make_chunk(0, 0))
    forged = _forgeries()
    for i, (data, _reason) in enumerate(forged.values()):
        _inject(kind, transport, tmp_path, chunk_file_name(0, 1 + i), data)
    expected: dict[str, int] = {}
    for _data, reason in forged.values():
        expected[reason] = expected.get(reason, 0) + 1
    if kind == "file":  # a file of 10 GiB (sparse) named as a chunk: never read
        with open(tmp_path / "spool" / "ready" / chunk_file_name(0, 50), "wb") as f:
            f.truncate(10 << 30)
        expected["too_large"] = 1
    writer.send(make_chunk(0, 99))
    out = tmp_path / "reader.json"
    with children() as kids:
        proc = _start(kids, read_forged, transport, str(out), 2, START_S)
        proc.join(START_S + 30)
        assert proc.exitcode == 0
    report = json.loads(out.read_text())
    assert [tuple(v) for v in report["valid"]] == [(0, 0), (0, 99)]
    assert report["stats"]["rejected"] == expected
    grown = report["peak_after"] - report["peak_before"]
    assert grown < 48 << 20, f"the reader's peak RSS grew by {grown / 2**20:.0f} MiB"
    assert report["rss_after"] - report["rss_before"] < 48 << 20
    writer.close()
