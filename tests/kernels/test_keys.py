"""The key codec on its own: round trips, bit boundaries, foreign and invalid keys,
against the reference codec (tests/kernels/reference.py) and by hand."""

from __future__ import annotations

import numpy as np
import pytest

from shardreplay.kernels import keys as codec
from shardreplay.spec import keys as spec_keys
from tests.kernels import reference as ref

LIMITS = (codec.MAX_SHARDS, codec.NUM_TAGS + 1, codec.MAX_PLACES, codec.GEN_MASK + 1)


def _fields(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    fields = [rng.integers(0, limit, n) for limit in LIMITS]
    for f, limit in zip(fields, LIMITS, strict=True):  # every field's extremes, too
        f[:4] = [0, 1, limit - 2, limit - 1]
    return fields


def test_layout_is_63_bits_in_the_documented_order() -> None:
    assert codec.SHARD_BITS + codec.TAG_BITS + codec.PLACE_BITS + codec.GEN_BITS == 63
    assert (codec.PLACE_SHIFT, codec.TAG_SHIFT, codec.SHARD_SHIFT) == (11, 39, 53)
    top = ref.encode_keys(*(np.array([limit - 1]) for limit in LIMITS))
    assert top[0] == np.iinfo(np.int64).max  # every field full: all 63 bits set, never negative
    one = [np.zeros(1, np.int64) for _ in LIMITS]
    for field, shift in enumerate((codec.SHARD_SHIFT, codec.TAG_SHIFT, codec.PLACE_SHIFT, 0)):
        parts = [p.copy() for p in one]
        parts[field][0] = 1
        assert ref.encode_keys(*parts)[0] == 1 << shift


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_and_reference(seed: int) -> None:
    fields = _fields(np.random.default_rng(seed), 5000)
    keys = ref.encode_keys(*fields)  # the kernels' encode_key: tests/kernels/test_windows.py
    assert (keys >= 0).all()
    for got, want, expected in zip(spec_keys.unpack_keys(keys), ref.decode_keys(keys), fields, strict=True):
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(want, expected)
    np.testing.assert_array_equal(spec_keys.key_shard(keys), fields[0])
    moved = spec_keys.with_shard(keys, 7)
    np.testing.assert_array_equal(spec_keys.key_shard(moved), 7)
    np.testing.assert_array_equal(moved & codec.LOCAL_MASK, keys & codec.LOCAL_MASK)


def test_generation_wraps_and_empty_input() -> None:
    keys = ref.encode_keys(*(np.zeros(3, np.int64) for _ in range(3)), np.array([2048, 2049, -1]))
    np.testing.assert_array_equal(spec_keys.unpack_keys(keys)[3], [0, 1, 2047])
    empty = np.zeros(0, np.int64)
    assert all(part.shape == (0,) for part in spec_keys.unpack_keys(empty))
    assert codec.keys_fit(empty, 1, 10).shape == (0,)
    assert spec_keys.unpack_keys(np.zeros((2, 0), np.int64))[0].shape == (2, 0)


def test_key_fits_rejects_foreign_and_invalid_keys() -> None:
    tag, size = 5, 100
    places = np.array([0, 50, size - 1])
    good = ref.encode_keys(np.zeros(3, np.int64), np.full(3, tag), places, np.arange(3))
    bad = np.concatenate([
        ref.encode_keys(np.array([1]), np.array([tag]), np.array([0]), np.array([0])),  # shard 1
        ref.encode_keys(np.array([0]), np.array([tag + 1]), np.array([0]), np.array([0])),  # other tag
        ref.encode_keys(np.array([0]), np.array([tag]), np.array([size]), np.array([0])),  # past the end
        np.array([-1, np.iinfo(np.int64).min, 0, 3]),  # negative; small integers carry tag 0
    ])
    assert codec.keys_fit(good, tag, size).all()
    assert not codec.keys_fit(bad, tag, size).any()
    mixed = np.random.default_rng(3).permutation(np.concatenate([good, bad]))
    np.testing.assert_array_equal(codec.keys_fit(mixed, tag, size), ref.key_fits(mixed, tag, size))


@pytest.mark.parametrize("seed", range(4))
def test_resolve_keys_against_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    streams, cap, tag, epoch = 3, 5, 9, int(rng.integers(0, 3000))
    pos = rng.integers(0, 4 * cap, streams)
    slots = rng.integers(0, streams * cap, 40)
    generation = ref.writes(pos, np.arange(streams * cap), cap).astype(np.uint32)
    gens = generation[slots] + epoch + rng.integers(-1, 2, 40)  # current, stale either way
    keys = ref.encode_keys(np.zeros(40, np.int64), np.full(40, tag), slots, gens)
    prios = rng.random(40).astype(np.float32)
    for bad_at, bad_key, bad_prio in ((None, None, None), (7, -5, None), (3, None, np.nan), (0, None, -1.0),
                                      (39, int(keys[0]) + (1 << codec.SHARD_SHIFT), None), (5, None, np.inf)):
        k, p = keys.copy(), prios.copy()
        if bad_key is not None:
            k[bad_at] = bad_key
        if bad_prio is not None:
            p[bad_at] = bad_prio
        got = codec.resolve_keys(k, p, generation, streams * cap, epoch, tag)
        want = ref.resolve_keys(k, p, generation, streams * cap, epoch, tag)
        assert got[:2] == want[:2]
        if got[0] == 0:  # the current keys' slots and priorities, in order
            n = got[4]
            np.testing.assert_array_equal(got[2][:n], want[2][want[3]])
            np.testing.assert_array_equal(got[3][:n], p[want[3]])
            assert want[3].any() and not want[3].all()


@pytest.mark.parametrize("seed", range(4))
def test_split_updates_against_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rank, size, n = int(rng.integers(0, 4)), 64, 50
    tags = np.array([3, 4, 0, 6])  # shard 2's tag not known yet: none of its keys passes
    shards = rng.choice([0, 1, 3], n)
    keys = ref.encode_keys(shards, tags[shards], rng.integers(0, size, n), rng.integers(0, 2048, n))
    keys[rng.random(n) < 0.2] = -1  # padding
    prios = rng.random(n).astype(np.float32)
    cases = [(keys, prios)]
    for j, value in ((4, -2), (9, int(ref.encode_keys(np.array([2]), np.array([0]), np.array([0]),
                                                           np.array([0]))[0])),
                     (11, int(ref.encode_keys(np.array([rank]), np.array([tags[rank] or 1]),
                                                np.array([size]), np.array([0]))[0]))):
        bad = keys.copy()
        bad[j] = value
        cases.append((bad, prios))
    nan = prios.copy()
    nan[6] = np.nan
    cases += [(keys, nan), (keys[:0], prios[:0])]
    for k, p in cases:
        got = codec.split_updates(k, p, rank, tags, size)
        want = ref.split_updates(k, p, rank, tags, size)
        assert got[:2] == want[:2]
        if got[0] != codec.OK:
            continue
        for g, w in zip(got[2:], want[2:], strict=True):
            np.testing.assert_array_equal(g, w)
