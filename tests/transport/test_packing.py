"""Packed chunks (frames once, compressed): bit-exact round trips and damage detection."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardreplay import Field, Spec
from shardreplay._hashing import xxh3_64
from shardreplay.errors import ConfigError, CorruptChunkError
from shardreplay.transport.codec import CODECS, Chunk, decode, encode, is_packed, pack, unpack

pytest.importorskip("lz4")
pytest.importorskip("zstandard")

MAX = 1 << 28


def _spec(stack: int, frame: tuple[int, ...] = (6, 5), dtype: type = np.uint8) -> Spec:
    return Spec({"obs": Field((stack, *frame), dtype, frame_stack=True), "action": Field((), np.int64),
                 "next": Field((2,), np.float32)})


def _episodes(rng: np.random.Generator, s: int, t: int, stack: int, frame: tuple[int, ...],
              reset_p: float, dtype: type = np.uint8) -> tuple[np.ndarray, np.ndarray]:
    """[S, T] steps of stacks that continue each other within an episode, as an env's
    frame stack does; an episode starts with its reset frame repeated; each stream
    starts mid-episode (its first stack is arbitrary)."""
    obs = np.zeros((s, t, stack, *frame), dtype)
    step_type = np.ones((s, t), np.uint8)
    for i in range(s):
        cur = rng.integers(0, 4, (stack, *frame)).astype(dtype)  # mid-episode start
        for j in range(t):
            if j and rng.random() < reset_p:
                cur = np.repeat(rng.integers(0, 4, (1, *frame)).astype(dtype), stack, axis=0)
                step_type[i, j] = 0
            elif j:
                cur = np.concatenate([cur[1:], rng.integers(0, 4, (1, *frame)).astype(dtype)])
            obs[i, j] = cur
    return obs, step_type


def _chunk(obs: np.ndarray, step_type: np.ndarray, priorities: bool, rng: np.random.Generator) -> Chunk:
    s, t = step_type.shape
    steps = {"obs": obs, "action": rng.integers(0, 5, (s, t)), "next": rng.random((s, t, 2), np.float32),
             "step_type": step_type, "discount": np.ones((s, t), np.float32)}
    prio = rng.random((s, t), np.float32) if priorities else None
    return Chunk(3, 7, 2, np.arange(10, 10 + s), steps, prio)


@settings(max_examples=60, deadline=None)
@given(s=st.integers(1, 4), t=st.integers(1, 12), stack=st.integers(1, 4), reset_p=st.floats(0, 0.5),
       priorities=st.booleans(), codec=st.sampled_from(CODECS), seed=st.integers(0, 2**32 - 1))
def test_round_trip_is_bit_exact(s: int, t: int, stack: int, reset_p: float, priorities: bool, codec: str,
                                 seed: int) -> None:
    rng = np.random.default_rng(seed)
    spec = _spec(stack)
    chunk = _chunk(*_episodes(rng, s, t, stack, (6, 5), reset_p), priorities, rng)
    plain = encode(chunk, spec)
    packed = pack(plain, spec, codec)
    assert is_packed(packed) and not is_packed(plain)
    assert bytes(unpack(packed, spec, max_bytes=MAX)) == plain
    back = decode(packed, spec, max_bytes=MAX)
    for name, value in chunk.steps.items():
        np.testing.assert_array_equal(back.steps[name], value)
    assert (back.actor_id, back.sequence, back.policy_version) == (3, 7, 2)


def test_continued_stacks_carry_one_frame() -> None:
    """Without compression the packed size shows what is sent: per stream, one whole
    stack for the first step and for each reset, one frame for every other step."""
    rng = np.random.default_rng(0)
    s, t, k, frame = 2, 40, 4, (16, 16)
    obs, step_type = _episodes(rng, s, t, k, frame, reset_p=0.1)
    spec = _spec(k, frame)
    plain = encode(_chunk(obs, step_type, False, rng), spec)
    resets = int((step_type[:, 1:] == 0).sum())
    frames = s * k + resets * k + (s * (t - 1) - resets)
    stacks_bytes = s * t * k * 256
    packed = pack(plain, spec, "none")
    expected = len(plain) - stacks_bytes + s * t + frames * 256 + 40
    assert len(packed) == expected


def test_spec_without_frame_stacks_is_only_compressed() -> None:
    spec = Spec({"obs": Field((8,), np.float32), "action": Field((), np.int64)})
    steps = {"obs": np.zeros((1, 50, 8), np.float32), "action": np.zeros((1, 50), np.int64),
             "step_type": np.ones((1, 50), np.uint8), "discount": np.ones((1, 50), np.float32)}
    plain = encode(Chunk(0, 0, 0, np.array([0]), steps), spec)
    packed = pack(plain, spec, "zstd")
    assert len(packed) < len(plain) / 4
    assert bytes(unpack(packed, spec, max_bytes=MAX)) == plain


def _damaged_header(packed: bytes, **fields: int) -> bytes:
    """``packed`` with header fields replaced and its checksum made right again."""
    out = bytearray(packed)
    names = ("total", "body_len", "chunk_len")
    for name, value in fields.items():
        struct.pack_into("<Q", out, 8 + 8 * names.index(name), value)
    struct.pack_into("<Q", out, 32, xxh3_64(memoryview(out)[40:]))
    return bytes(out)


@pytest.fixture
def packed_case() -> tuple[Spec, bytes, bytes]:
    rng = np.random.default_rng(1)
    spec = _spec(4)
    plain = encode(_chunk(*_episodes(rng, 2, 10, 4, (6, 5), 0.2), True, rng), spec)
    return spec, plain, pack(plain, spec, "lz4")


def test_damage_is_detected(packed_case: tuple[Spec, bytes, bytes]) -> None:
    spec, _plain, packed = packed_case
    for at in (41, len(packed) // 2, len(packed) - 1):
        bad = bytearray(packed)
        bad[at] ^= 0x10
        with pytest.raises(CorruptChunkError) as err:
            decode(bytes(bad), spec, max_bytes=MAX)
        assert err.value.reason == "checksum"
    with pytest.raises(CorruptChunkError) as err:
        decode(packed[:-3], spec, max_bytes=MAX)
    assert err.value.reason == "truncated"


def test_sizes_are_checked_before_allocating(packed_case: tuple[Spec, bytes, bytes]) -> None:
    spec, plain, packed = packed_case
    with pytest.raises(CorruptChunkError) as err:  # a decompression bomb claims a huge chunk
        unpack(_damaged_header(packed, chunk_len=1 << 40), spec, max_bytes=MAX)
    assert err.value.reason == "too_large"
    with pytest.raises(CorruptChunkError) as err:
        unpack(packed, spec, max_bytes=len(plain) - 1)
    assert err.value.reason == "too_large"
    with pytest.raises(CorruptChunkError):  # a body length that lies
        unpack(_damaged_header(packed, body_len=100), spec, max_bytes=MAX)


def test_damaged_flags_are_refused() -> None:
    """A flag that says "continues" at a stream's first step cannot be rebuilt."""
    rng = np.random.default_rng(2)
    spec = _spec(3)
    plain = encode(_chunk(*_episodes(rng, 1, 6, 3, (6, 5), 0.0), False, rng), spec)
    packed = bytearray(pack(plain, spec, "none"))
    body = packed[40:]
    flags_at = body.index(bytes([0, 1, 1, 1, 1, 1]))
    packed[40 + flags_at] = 1
    struct.pack_into("<Q", packed, 32, xxh3_64(memoryview(packed)[40:]))
    with pytest.raises(CorruptChunkError, match="flags"):
        unpack(bytes(packed), spec, max_bytes=MAX)


def test_unknown_codec_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="none, lz4, zstd"):
        pack(b"", _spec(2), "gzip")


def _stacked_chunks(spec: Spec, n: int) -> list[Chunk]:
    """``n`` chunks of one actor, two streams of 16 steps each, continuing stacks."""
    rng = np.random.default_rng(5)
    out = []
    for seq in range(n):
        c = _chunk(*_episodes(rng, 2, 16, 4, (6, 5), 0.1), seq % 2 == 0, rng)
        out.append(Chunk(0, seq, 1, np.arange(2), c.steps, c.priorities))
    return out


def _receive(reader: object, n: int) -> list[Chunk]:
    got: list[Chunk] = []
    for _ in range(200):
        batch = reader.receive(n - len(got), timeout_s=0.1)  # type: ignore[attr-defined]
        reader.ack(batch)  # type: ignore[attr-defined]
        got += batch
        if len(got) == n:
            return got
    raise AssertionError(f"received {len(got)} of {n} chunks")


def _assert_same(got: list[Chunk], sent: list[Chunk]) -> None:
    assert [c.sequence for c in got] == [c.sequence for c in sent]
    for a, b in zip(got, sent, strict=True):
        for name, value in b.steps.items():
            np.testing.assert_array_equal(a.steps[name], value)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_spool_sends_frames_once(tmp_path: Path, compression: str) -> None:
    """A frame-stacked spec is packed on the wire even without compression."""
    from shardreplay.transport import open_transport

    spec = _spec(4)
    transport = open_transport(tmp_path.absolute().as_uri(), spec, compression=compression)
    sent = _stacked_chunks(spec, 6)
    writer = transport.writer()
    for c in sent:
        writer.send(c)
    files = sorted((tmp_path / "ready").iterdir())
    assert len(files) == 6 and all(f.read_bytes()[:4] == b"SRCZ" for f in files)
    plain = sum(len(encode(c, spec)) for c in sent)
    assert sum(f.stat().st_size for f in files) < plain * 0.6
    _assert_same(_receive(transport.reader(), 6), sent)


@pytest.mark.redis
def test_redis_sends_packed_chunks(redis_server: object) -> None:
    import redis

    from shardreplay.transport import open_transport

    spec = _spec(4)
    url = redis_server.url  # type: ignore[attr-defined]
    transport = open_transport(url, spec, stream="t:packed", compression="lz4")
    sent = _stacked_chunks(spec, 5)
    writer = transport.writer()
    for c in sent:
        writer.send(c)
    got = _receive(transport.reader(), 5)
    _assert_same(got, sent)
    entries = redis.Redis.from_url(url).xrange("t:packed")
    assert entries and all(next(iter(fields.values()))[:4] == b"SRCZ" for _id, fields in entries)


def test_plain_specs_stay_byte_identical_without_compression(tmp_path: Path) -> None:
    from shardreplay.transport import open_transport

    spec = Spec({"obs": Field((3,), np.float32)})
    steps = {"obs": np.ones((1, 4, 3), np.float32), "step_type": np.ones((1, 4), np.uint8),
             "discount": np.ones((1, 4), np.float32)}
    chunk = Chunk(0, 0, 0, np.array([0]), steps)
    open_transport(tmp_path.absolute().as_uri(), spec).writer().send(chunk)
    (only,) = (tmp_path / "ready").iterdir()
    assert only.read_bytes() == encode(chunk, spec)


def test_unknown_compression_is_refused_when_the_transport_opens(tmp_path: Path) -> None:
    from shardreplay.transport import open_transport

    with pytest.raises(ConfigError, match="none, lz4, zstd"):
        open_transport(tmp_path.absolute().as_uri(), _spec(2), compression="brotli")


def _pong_sized_chunk(seed: int) -> tuple[Spec, Chunk]:
    """32 steps of 4x84x84 stacks, the size a Pong actor ships (about 0.9 MB plain)."""
    spec = _spec(4, (84, 84))
    rng = np.random.default_rng(seed)
    obs, step_type = _episodes(rng, 1, 32, 4, (84, 84), 0.0)
    return spec, _chunk(obs, step_type, False, rng)


def _peak_bytes(fn: object) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()  # type: ignore[operator]
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_packed_encoding_is_pack_of_encode_and_its_scratch_is_not_shared() -> None:
    from shardreplay.transport.codec import PackedEncoding

    spec, first = _pong_sized_chunk(0)
    _, second = _pong_sized_chunk(1)
    a = PackedEncoding(first, spec, "lz4")
    b = PackedEncoding(second, spec, "lz4")  # reuses the scratch buffer a was packed from
    for enc, chunk in ((a, first), (b, second)):
        out = bytearray(enc.nbytes)
        enc.write_into(out)
        assert bytes(out) == pack(encode(chunk, spec), spec, "lz4")


def test_packing_and_unpacking_allocate_no_extra_chunk_sized_copies() -> None:
    # An actor packs a chunk without new chunk-sized objects (it allocated the plain
    # encoding twice, then packed it), and the learner rebuilds it once (np.take's
    # default mode copied the rebuilt stacks through a temporary as large as the chunk).
    from shardreplay.transport.codec import PackedEncoding

    spec, chunk = _pong_sized_chunk(2)
    plain = len(encode(chunk, spec))
    PackedEncoding(chunk, spec, "lz4")  # the thread's scratch buffer exists from here on (was: 2x)
    # Left: the frame comparison's booleans (3/4 of the chunk) and the body (1/4).
    assert _peak_bytes(lambda: PackedEncoding(chunk, spec, "lz4")) < 1.5 * plain
    packed = pack(encode(chunk, spec), spec, "lz4")
    assert _peak_bytes(lambda: unpack(packed, spec, max_bytes=MAX)) < 1.5 * plain  # was: 2.3x
