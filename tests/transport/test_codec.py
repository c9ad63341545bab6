"""The chunk wire format: round trips, and every kind of damage is a CorruptChunkError."""

from __future__ import annotations

import pathlib
import re
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardreplay._hashing import xxh3_64
from shardreplay.errors import CorruptChunkError, SpecMismatchError
from shardreplay.spec import Field, Spec
from shardreplay.transport import codec
from shardreplay.transport.codec import Chunk, decode, encode
from tests.transport.transport_helpers import SPEC, assert_same_chunk, make_chunk

MAX = 1 << 30
DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "int64", "uint64", "float16", "float32",
          "float64"]


@st.composite
def specs_and_chunks(draw: st.DrawFn) -> tuple[Spec, Chunk]:
    n = draw(st.integers(1, 3))
    shapes = st.lists(st.integers(0, 3), max_size=2)
    fields = {f"f{i}": Field(tuple(draw(shapes)), draw(st.sampled_from(DTYPES))) for i in range(n)}
    spec = Spec({"nest": fields} if draw(st.booleans()) else fields)
    chunk = make_chunk(draw(st.integers(0, 2**40)), draw(st.integers(0, 2**62)), s=draw(st.integers(1, 4)),
                       t=draw(st.integers(1, 5)), spec=spec, priorities=draw(st.booleans()),
                       seed=draw(st.integers(0, 1000)))
    return spec, chunk


@settings(max_examples=150, deadline=None)
@given(specs_and_chunks())
def test_round_trip_any_shapes_and_dtypes(case: tuple[Spec, Chunk]) -> None:
    spec, chunk = case
    data = encode(chunk, spec)
    back = decode(data, spec, max_bytes=MAX)
    assert_same_chunk(chunk, back)
    assert decode(bytearray(data), spec, max_bytes=MAX).identity == chunk.identity
    assert decode(memoryview(data), spec, max_bytes=MAX).identity == chunk.identity


def test_decoded_arrays_are_read_only_views_of_the_input() -> None:
    data = encode(make_chunk(s=3, t=4), SPEC)
    back = decode(data, SPEC, max_bytes=MAX)
    obs = back.steps["obs"]
    assert not obs.flags.writeable
    start = np.frombuffer(data, np.uint8)
    assert np.shares_memory(obs, start)
    assert all((a.ctypes.data - start.ctypes.data) % 8 == 0 for a in back.steps.values())


def test_discount_defaults_to_one_and_dtypes_are_normalised() -> None:
    chunk = make_chunk()
    steps = dict(chunk.steps)
    del steps["discount"]
    steps["step_type"] = steps["step_type"].astype(np.int64)
    back = decode(encode(Chunk(1, 2, 3, chunk.stream_ids, steps), SPEC), SPEC, max_bytes=MAX)
    assert back.steps["discount"].dtype == np.float32 and (back.steps["discount"] == 1).all()
    assert back.steps["step_type"].dtype == np.uint8


def test_every_damaged_byte_is_detected() -> None:
    data = encode(make_chunk(s=2, t=3, priorities=True), SPEC)
    for i in range(len(data)):
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(data)
            bad[i] ^= mask
            with pytest.raises(CorruptChunkError):
                decode(bytes(bad), SPEC, max_bytes=MAX)


def test_truncation_and_padding_at_every_length_are_detected() -> None:
    data = encode(make_chunk(s=2, t=3, priorities=True), SPEC)
    for n in range(len(data)):
        with pytest.raises(CorruptChunkError) as info:
            decode(data[:n], SPEC, max_bytes=MAX)
        assert info.value.reason == "truncated"
    with pytest.raises(CorruptChunkError) as info:
        decode(data + b"\0", SPEC, max_bytes=MAX)
    assert info.value.reason == "truncated"


def test_wrong_spec_is_rejected_with_reason_spec() -> None:
    other = Spec({"obs": Field((5,), np.float32), "action": Field((), np.int64),
                  "reward": Field((), np.float32)})
    with pytest.raises(CorruptChunkError) as info:
        decode(encode(make_chunk(), SPEC), other, max_bytes=MAX)
    assert info.value.reason == "spec"


def test_chunks_over_max_bytes_are_rejected_first() -> None:
    data = encode(make_chunk(), SPEC)
    with pytest.raises(CorruptChunkError) as info:
        decode(data, SPEC, max_bytes=len(data) - 1)
    assert info.value.reason == "too_large"
    decode(data, SPEC, max_bytes=len(data))


def _forge(header: object, payload: bytes = b"", *, header_len: int | None = None,
           raw_header: bytes | None = None, ids: tuple[int, int, int] = (0, 0, 0)) -> bytes:
    """A chunk with a valid prefix and checksum around any header and ids (actor,
    sequence, policy version): tests header checks."""
    head = raw_header if raw_header is not None else msgpack.packb(header)
    pad = bytes((-(codec._PREFIX.size + len(head))) % 8)
    total = codec._PREFIX.size + len(head) + len(pad) + len(payload)
    data = bytearray(codec._PREFIX.pack(codec.MAGIC, codec.FORMAT_VERSION,
                                        len(head) if header_len is None else header_len, total, 0, *ids))
    data += head + pad + payload
    data[24:32] = xxh3_64(memoryview(data)[32:]).to_bytes(8, "little")
    return bytes(data)


def _valid_header(priorities: bool = False) -> tuple[dict, bytes]:
    data = encode(make_chunk(s=2, t=3, priorities=priorities), SPEC)
    hlen = codec._PREFIX.unpack_from(data)[2]
    head = msgpack.unpackb(data[codec._PREFIX.size:codec._PREFIX.size + hlen])
    payload = data[(codec._PREFIX.size + hlen + 7) // 8 * 8:]
    return head, payload


@pytest.mark.parametrize("mutate", [
    lambda h: h.update(S=2**40),
    lambda h: h.update(T=2**40),
    lambda h: h.update(S=-1),
    lambda h: h.update(S="2"),
    lambda h: h.update(a=5),  # format 2 kept the ids in the header: no more
    lambda h: h.update(extra=None),
    lambda h: h["arrays"][1].__setitem__(4, 2**62),
    lambda h: h["arrays"][1].__setitem__(3, 2**62),
    lambda h: h["arrays"][1].__setitem__(2, [2**20, 2**20, 2**20]),
    lambda h: h["arrays"][1].__setitem__(1, "<f8"),
    lambda h: h["arrays"].pop(),
    lambda h: h["arrays"].append(["priorities", "<f4", [2, 3], 10**12, 24]),
    lambda h: h.update(arrays="x"),
    lambda h: h.pop("fp"),
])
def test_absurd_headers_are_rejected_without_allocating(mutate) -> None:
    head, payload = _valid_header()
    mutate(head)
    data = _forge(head, payload)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptChunkError):
            decode(data, SPEC, max_bytes=MAX)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize("raw", [
    b"\xdd\x7f\xff\xff\xff",  # msgpack array32 claiming 2**31 elements, none present
    b"\xdb\x7f\xff\xff\xff",  # str32 claiming 2 GiB
    b"\xc1",  # never-used byte
    msgpack.packb([1, 2, 3]),
    b"",
])
def test_malformed_msgpack_headers_are_rejected(raw: bytes) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(CorruptChunkError) as info:
            decode(_forge(None, raw_header=raw), SPEC, max_bytes=MAX)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.reason in ("header", "spec")
    assert peak < 1 << 20


def test_header_length_beyond_the_chunk_is_rejected() -> None:
    head, payload = _valid_header()
    with pytest.raises(CorruptChunkError) as info:
        decode(_forge(head, payload, header_len=2**32 - 1), SPEC, max_bytes=MAX)
    assert info.value.reason == "header"


def _with_payload_edit(edit) -> bytes:
    head, payload = _valid_header(priorities=True)
    arr = bytearray(payload)
    edit(head, arr)
    return _forge(head, bytes(arr))


def _entry(head: dict, name: str) -> list:
    return next(e for e in head["arrays"] if e[0] == name)


@pytest.mark.parametrize("edit", [
    lambda h, p: p.__setitem__(slice(_entry(h, "steps/obs")[3], _entry(h, "steps/obs")[3] + 4),
                               np.float32(np.nan).tobytes()),
    lambda h, p: p.__setitem__(_entry(h, "steps/step_type")[3], 7),
    lambda h, p: p.__setitem__(slice(_entry(h, "steps/discount")[3], _entry(h, "steps/discount")[3] + 4),
                               np.float32(2.0).tobytes()),
    lambda h, p: p.__setitem__(slice(_entry(h, "stream_ids")[3] + 8, _entry(h, "stream_ids")[3] + 16),
                               p[_entry(h, "stream_ids")[3]:_entry(h, "stream_ids")[3] + 8]),
    lambda h, p: p.__setitem__(slice(_entry(h, "stream_ids")[3], _entry(h, "stream_ids")[3] + 8),
                               np.int64(-3).tobytes()),
    lambda h, p: p.__setitem__(slice(_entry(h, "priorities")[3], _entry(h, "priorities")[3] + 4),
                               np.float32(-1.0).tobytes()),
    lambda h, p: p.__setitem__(slice(_entry(h, "priorities")[3], _entry(h, "priorities")[3] + 4),
                               np.float32(np.inf).tobytes()),
])
def test_invalid_values_under_a_valid_checksum_are_rejected(edit) -> None:
    with pytest.raises(CorruptChunkError) as info:
        decode(_with_payload_edit(edit), SPEC, max_bytes=MAX)
    assert info.value.reason == "values"


def test_numpy_ids_and_float64_priorities_are_accepted() -> None:
    chunk = make_chunk(priorities=True)
    prio = chunk.priorities.astype(np.float64)
    back = decode(encode(Chunk(np.int64(3), np.uint32(4), np.int8(5), chunk.stream_ids.astype(np.int32),
                               chunk.steps, prio), SPEC), SPEC, max_bytes=MAX)
    assert back.identity == (3, 4) and back.policy_version == 5
    assert back.priorities.dtype == np.float32
    with pytest.raises(SpecMismatchError, match="priorities"):
        encode(Chunk(0, 0, 0, chunk.stream_ids, chunk.steps, np.full((2, 3), 1e300)), SPEC)


def test_encode_rejects_negative_or_nan_priorities() -> None:
    chunk = make_chunk(priorities=True)
    for bad in (-1.0, np.nan):
        prio = chunk.priorities.copy()
        prio[0, 0] = bad
        with pytest.raises(SpecMismatchError, match="priorities"):
            encode(Chunk(0, 0, 0, chunk.stream_ids, chunk.steps, prio), SPEC)


def test_encode_rejects_bad_chunks_at_the_actor() -> None:
    chunk = make_chunk()
    steps = dict(chunk.steps)
    steps["obs"] = steps["obs"][:, :, :3]
    with pytest.raises(SpecMismatchError, match="obs"):
        encode(Chunk(0, 0, 0, chunk.stream_ids, steps), SPEC)
    with pytest.raises(SpecMismatchError, match="actor_id"):
        encode(Chunk(-1, 0, 0, chunk.stream_ids, chunk.steps), SPEC)
    with pytest.raises(SpecMismatchError, match="distinct"):
        encode(Chunk(0, 0, 0, np.array([0, 2**63 + 5], np.uint64), chunk.steps), SPEC)
    with pytest.raises(SpecMismatchError, match="distinct"):
        encode(Chunk(0, 0, 0, np.zeros(2, np.int64), chunk.steps), SPEC)
    with pytest.raises(SpecMismatchError, match="step_type"):
        encode(Chunk(0, 0, 0, chunk.stream_ids, {k: v for k, v in steps.items() if k != "step_type"}), SPEC)


def test_no_pickle_in_transport_or_policy_code() -> None:
    root = pathlib.Path(codec.__file__).resolve().parents[1]
    for path in [*(root / "transport").glob("*.py"), *(root / "policy").glob("*.py")]:
        text = path.read_text()
        assert not re.search(r"^\s*(import|from) (c|cloud)?pickle", text, re.M), path
        assert "pickle.load" not in text and "torch.load(" not in text, path


def test_codec_caches_never_mix_up_specs() -> None:
    # Regression: cached layouts outlived their spec entry and a new spec reused its id.
    for i in range(300):
        spec = Spec({f"f{j}": Field((i % 3 + j,), DTYPES[(i + j) % len(DTYPES)]) for j in range(1 + i % 3)})
        chunk = make_chunk(0, i, spec=spec, seed=i)
        assert_same_chunk(chunk, decode(encode(chunk, spec), spec, max_bytes=MAX))


def test_older_or_unknown_formats_are_rejected_with_a_reason() -> None:
    data = bytearray(encode(make_chunk(), SPEC))
    for version, says in ((1, "older shardreplay, CRC-32"), (2, "older shardreplay, XXH64"), (4, "format 4"),
                          (255, "format 255")):
        data[4] = version
        with pytest.raises(CorruptChunkError, match=says) as info:
            decode(bytes(data), SPEC, max_bytes=MAX)
        assert info.value.reason == "format"
    data[4] = codec.FORMAT_VERSION
    data[21] = 1  # the reserved zero bytes of the prefix
    with pytest.raises(CorruptChunkError) as info:
        decode(bytes(data), SPEC, max_bytes=MAX)
    assert info.value.reason == "format"


def test_chunk_lengths_are_multiples_of_8() -> None:
    for s, t in ((1, 1), (3, 5), (2, 7)):  # S*T odd: uint8 step types end off 8
        assert len(encode(make_chunk(s=s, t=t), SPEC)) % 8 == 0


def test_decoded_steps_are_validated_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardreplay.buffer.replay_buffer import ReplayBuffer
    from shardreplay.spec import validation as spec_module

    back = decode(encode(make_chunk(s=2, t=3), SPEC), SPEC, max_bytes=MAX)
    assert all(not a.flags.writeable for a in back.steps.values())
    buffer = ReplayBuffer(SPEC, num_streams=2, stream_capacity=8, window=1)
    calls = []
    real = spec_module._checked
    monkeypatch.setattr(spec_module, "_checked", lambda *a: calls.append(a[0]) or real(*a))
    buffer.extend(back.steps, stream_ids=back.stream_ids)
    assert calls == [] and buffer.num_steps == 6  # sealed by decode: not checked again
    buffer.extend(dict(back.steps), stream_ids=back.stream_ids)
    assert calls  # a plain mapping of the same arrays is checked
    with pytest.raises(TypeError, match=r"Spec\.validated"):
        spec_module.ValidatedSteps(SPEC, (2, 3), dict(back.steps), object())
    other = Spec({"obs": Field((4,), np.float32)})
    assert not back.steps.accepted_by(other, (2, 3)) and not back.steps.accepted_by(SPEC, (3, 2))


_SPECIALS = [0.0, -0.0, 1.0, np.nextafter(np.float32(1), np.float32(2)), -1e-45, 1e-45, 0.5, np.nan, -np.nan,
             np.inf, -np.inf, 3.4e38, -3.4e38]


@pytest.mark.parametrize("field", ["f32", "f64", "loose", "half", "discount", "step_type"])
def test_compiled_value_checks_agree_with_spec_validate(field: str) -> None:
    # decode checks every value of a chunk in one compiled pass (validation.validated_packed),
    # or field by field where a dtype has no compiled check (finite float16): either way
    # it must accept exactly what Spec.validate accepts, and name the field it refuses.
    spec = Spec({"f32": Field((3,), np.float32), "f64": Field((), np.float64),
                 "loose": Field((), np.float32, finite=False), "half": Field((2,), np.float16)})
    base = make_chunk(s=2, t=3, spec=spec, seed=1)
    specials = [*_SPECIALS, 2, 3, 255] if field == "step_type" else _SPECIALS
    outcomes = set()
    for value in specials:
        steps = {k: np.array(v) for k, v in base.steps.items()}
        steps.setdefault("discount", np.ones((2, 3), np.float32))
        target = steps[field]
        if field == "step_type":
            if not float(value).is_integer() or not 0 <= value <= 255:
                continue
            target[1, 2] = int(value)
        else:
            with np.errstate(over="ignore"):  # 3.4e38 is inf in float16: refused, as it should be
                target.reshape(-1)[-1] = value
        try:
            spec.validate(steps, (2, 3))
            expected = None
        except SpecMismatchError as exc:
            expected = str(exc)
        data = bytearray(encode(Chunk(0, 0, 0, base.stream_ids, base.steps), spec))
        # Forge the edited value under a valid checksum (encode would refuse it).
        hlen = codec._PREFIX.unpack_from(data)[2]
        head = msgpack.unpackb(data[codec._PREFIX.size:codec._PREFIX.size + hlen])
        at = (codec._PREFIX.size + hlen + 7) // 8 * 8
        entry = next(e for e in head["arrays"] if e[0] == f"steps/{field}")
        edited = np.ascontiguousarray(target, np.dtype(entry[1])).tobytes()
        data[at + entry[3]:at + entry[3] + entry[4]] = edited
        data[24:32] = xxh3_64(memoryview(data)[32:]).to_bytes(8, "little")
        outcomes.add(expected is None)
        if expected is None:
            back = decode(bytes(data), spec, max_bytes=MAX)
            assert np.array_equal(back.steps[field], target, equal_nan=True), (field, value)
        else:
            with pytest.raises(CorruptChunkError, match=re.escape(field)) as info:
                decode(bytes(data), spec, max_bytes=MAX)
            assert info.value.reason == "values", (field, value)
    assert outcomes == ({True} if field == "loose" else {True, False})  # both paths exercised


@pytest.mark.parametrize("ids", [(2**63, 0, 0), (0, 2**64 - 1, 0), (0, 0, 2**63)])
def test_ids_beyond_int63_in_the_prefix_are_rejected(ids: tuple[int, int, int]) -> None:
    head, payload = _valid_header()
    back = decode(_forge(head, payload, ids=(7, 2**63 - 1, 3)), SPEC, max_bytes=MAX)
    assert back.identity == (7, 2**63 - 1) and back.policy_version == 3
    with pytest.raises(CorruptChunkError) as info:
        decode(_forge(head, payload, ids=ids), SPEC, max_bytes=MAX)
    assert info.value.reason == "header"


def test_a_header_checked_once_still_needs_its_payload() -> None:
    # Headers are recognised by their bytes after the first full check; the payload's
    # length and every value are still checked for each chunk.
    head, payload = _valid_header()
    decode(_forge(head, payload), SPEC, max_bytes=MAX)
    for short in (payload[:-8], payload + bytes(8)):
        with pytest.raises(CorruptChunkError) as info:
            decode(_forge(head, short), SPEC, max_bytes=MAX)
        assert info.value.reason == "header"
    other = Spec({**SPEC.fields, "extra": Field((), np.int8)})
    with pytest.raises(CorruptChunkError) as info:  # another spec has its own cache
        decode(_forge(head, payload), other, max_bytes=MAX)
    assert info.value.reason == "spec"


@pytest.mark.parametrize(("ids", "ok"), [([0, 0], False), ([-3, 1], False), ([1, 2**63 - 1], True)])
def test_stream_ids_checked_once_are_recognised_and_others_still_checked(ids: list[int], ok: bool) -> None:
    # Decode remembers stream ids that passed (by their bytes) and skips their checks;
    # any other ids, even after many good chunks of the same layout, are checked in full.
    head, payload = _valid_header()
    at = _entry(head, "stream_ids")[3]
    for _ in range(3):
        assert decode(_forge(head, payload), SPEC, max_bytes=MAX).stream_ids.tolist() == [0, 1]
    other = bytearray(payload)
    other[at:at + 16] = np.array(ids, np.int64).tobytes()
    for _ in range(2):  # a failed check is never remembered: rejected every time
        if ok:  # the control: unseen legal ids pass
            assert decode(_forge(head, bytes(other)), SPEC, max_bytes=MAX).stream_ids.tolist() == ids
            continue
        with pytest.raises(CorruptChunkError) as info:
            decode(_forge(head, bytes(other)), SPEC, max_bytes=MAX)
        assert info.value.reason == "values"
    assert decode(_forge(head, payload), SPEC, max_bytes=MAX).stream_ids.tolist() == [0, 1]


def test_decoding_a_writable_buffer_gives_read_only_views() -> None:
    data = bytearray(encode(make_chunk(s=2, t=3, priorities=True), SPEC))
    back = decode(data, SPEC, max_bytes=MAX)
    arrays = [back.stream_ids, back.priorities, *back.steps.values()]
    assert all(not a.flags.writeable for a in arrays)
    assert all(np.shares_memory(a, np.frombuffer(data, np.uint8)) for a in arrays)


def _exact_steps(chunk: Chunk) -> dict[str, np.ndarray]:
    """The chunk's steps as a dict of arrays of the spec's exact dtypes (the encoder's
    fast path: values checked in the written bytes)."""
    steps = {k: np.array(v, SPEC[k].dtype) for k, v in chunk.steps.items() if k in SPEC.names}
    steps["step_type"] = np.array(chunk.steps["step_type"], np.uint8)
    steps["discount"] = np.array(chunk.steps["discount"], np.float32)
    return steps


@pytest.mark.parametrize(("field", "value"), [("obs", np.nan), ("obs", -np.inf), ("reward", np.inf),
                                              ("step_type", 3), ("discount", 1.5), ("discount", -0.25),
                                              ("discount", np.nan)])
def test_exact_dtype_steps_with_a_bad_value_are_rejected_naming_the_field(field: str, value: float) -> None:
    chunk = make_chunk(s=3, t=4)
    steps = _exact_steps(chunk)
    assert decode(encode(Chunk(0, 0, 0, chunk.stream_ids, steps), SPEC), SPEC, max_bytes=MAX)  # control
    rng = np.random.default_rng(7)
    for _ in range(5):  # the bad value anywhere in the array
        bad = {k: v.copy() for k, v in steps.items()}
        bad[field].reshape(-1)[rng.integers(bad[field].size)] = value
        with pytest.raises(SpecMismatchError, match=field):
            encode(Chunk(0, 0, 0, chunk.stream_ids, bad), SPEC)
        with pytest.raises(SpecMismatchError, match=field):  # the same verdict as validate
            SPEC.validate(bad, (3, 4))


def test_encode_accepts_and_rejects_what_spec_validate_does() -> None:
    # Random edits of exact-dtype steps (the fast path) and of cast ones (validate):
    # encode raises exactly when Spec.validate does, and what it accepts round-trips.
    rng = np.random.default_rng(11)
    specials = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1.0, 1.0000001, 2.0, -1e-30, 3, 255]
    seen = set()
    for i in range(300):
        chunk = make_chunk(0, i, s=2, t=3)
        steps = _exact_steps(chunk)
        name = str(rng.choice(["obs", "reward", "step_type", "discount", "action"]))
        with np.errstate(invalid="ignore", over="ignore"):
            steps[name].reshape(-1)[rng.integers(steps[name].size)] = np.asarray(
                rng.choice(specials)).astype(steps[name].dtype)
        if rng.random() < 0.3:
            steps["reward"] = steps["reward"].astype(np.float64)  # a cast: validate's path
        try:
            SPEC.validate(steps, (2, 3))
            ok = True
        except SpecMismatchError:
            ok = False
        seen.add(ok)
        if ok:
            back = decode(encode(Chunk(0, i, 0, chunk.stream_ids, steps), SPEC), SPEC, max_bytes=MAX)
            want = SPEC.validate(steps, (2, 3))[name]
            assert np.array_equal(back.steps[name], want, equal_nan=want.dtype.kind == "f")
        else:
            with pytest.raises(SpecMismatchError):
                encode(Chunk(0, i, 0, chunk.stream_ids, steps), SPEC)
    assert seen == {True, False}


def test_big_endian_fields_decode_to_their_values() -> None:
    # The wire is little-endian; decoded views must read it as such, whatever the spec's
    # byte order (an earlier decoder viewed the bytes with the spec's own dtype).
    spec = Spec({"big": Field((3,), ">f8", finite=False), "i": Field((), ">i4"), "f": Field((), ">f4")})
    steps = {"big": np.arange(6, dtype=">f8").reshape(2, 1, 3), "i": np.array([[5], [-7]], ">i4"),
             "f": np.array([[0.5], [2.0]], ">f4"), "step_type": np.zeros((2, 1), np.uint8)}
    back = decode(encode(Chunk(0, 0, 0, np.arange(2), steps), spec), spec, max_bytes=MAX)
    for name in ("big", "i", "f"):
        np.testing.assert_array_equal(back.steps[name], steps[name], err_msg=name)
