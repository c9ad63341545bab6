"""The samples-per-insert rate limiter: Reverb's rules, deadlock-free configurations only."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardreplay.errors import ConfigError
from shardreplay.runtime.learner.sync import RateLimiter


def test_docstring_timeline() -> None:
    rl = RateLimiter(2, min_size_to_sample=2, error_buffer=4)
    assert (rl.min_diff, rl.max_diff) == (0.0, 8.0)
    assert not rl.can_sample()
    rl.insert()
    assert not rl.can_sample()
    rl.insert()
    assert rl.diff == 4 and rl.can_sample()
    for _ in range(4):
        assert rl.can_sample()
        rl.sample()
    assert rl.diff == 0 and not rl.can_sample()
    for _ in range(4):
        assert rl.can_insert()
        rl.insert()
    assert rl.diff == 8 and not rl.can_insert() and rl.can_sample()


def test_filling_up_is_free_until_min_size() -> None:
    rl = RateLimiter(0.5, min_size_to_sample=100, error_buffer=10, max_insert_size=10)
    for _ in range(10):
        assert rl.can_insert(10)
        rl.insert(10)
    assert rl.inserts == 100 and rl.can_sample()


@pytest.mark.parametrize("spi", [0.25, 1.0, 4.0, 32.0])
def test_the_replay_ratio_is_held(spi: float) -> None:
    rl = RateLimiter(spi, min_size_to_sample=50, error_buffer=max(40, 4 * spi + 8), max_insert_size=4,
                     max_sample_size=8)
    rng = random.Random(0)
    for _ in range(20_000):
        n, m = rng.randint(1, 4), rng.randint(1, 8)
        if rng.random() < 0.5 and rl.can_sample(m):
            rl.sample(m)
        elif rl.can_insert(n):
            rl.insert(n)
        elif rl.can_sample(m):
            rl.sample(m)
        if rl.inserts >= rl.min_size_to_sample:
            assert rl.min_diff <= rl.diff <= rl.max_diff
    assert rl.samples / rl.inserts == pytest.approx(spi, rel=0.05)


@st.composite
def configs(draw: st.DrawFn) -> dict:
    spi = draw(st.sampled_from([0.1, 0.5, 1.0, 2.0, 3.5, 16.0]))
    n, m = draw(st.integers(1, 6)), draw(st.integers(1, 64))
    lo = draw(st.floats(-100, 100))
    width = draw(st.floats(0, 200))
    buf = draw(st.one_of(st.floats(0, 200), st.just((lo, lo + width))))
    return {"samples_per_insert": spi, "min_size_to_sample": draw(st.integers(1, 40)), "error_buffer": buf,
            "max_insert_size": n, "max_sample_size": m}


@settings(max_examples=400, deadline=None)
@given(configs(), st.integers(0, 2**32))
def test_accepted_configurations_never_deadlock(config: dict, seed: int) -> None:
    try:
        rl = RateLimiter(**config)
    except ConfigError:
        return
    rng = random.Random(seed)
    for _ in range(300):
        n, m = rng.randint(1, rl.max_insert_size), rng.randint(1, rl.max_sample_size)
        ok_insert, ok_sample = rl.can_insert(n), rl.can_sample(m)
        assert ok_insert or ok_sample, f"deadlock at {rl!r} with n={n}, m={m}"
        if ok_sample and (not ok_insert or rng.random() < 0.5):
            rl.sample(m)
        else:
            rl.insert(n)


@pytest.mark.parametrize("kwargs, match", [
    ({"samples_per_insert": 1, "min_size_to_sample": 1, "error_buffer": 0.5}, "narrower"),
    ({"samples_per_insert": 4, "min_size_to_sample": 10, "error_buffer": 2}, "narrower"),
    ({"samples_per_insert": 1, "min_size_to_sample": 10, "error_buffer": 20, "max_sample_size": 64},
     "narrower"),
    ({"samples_per_insert": 1, "min_size_to_sample": 10, "error_buffer": (-30.0, 12.0),
      "max_insert_size": 8}, "before min_size_to_sample"),
    ({"samples_per_insert": 0, "min_size_to_sample": 1, "error_buffer": 5}, "samples_per_insert"),
    ({"samples_per_insert": float("nan"), "min_size_to_sample": 1, "error_buffer": 5}, "samples_per_insert"),
    ({"samples_per_insert": 1, "min_size_to_sample": 0, "error_buffer": 5}, "min_size_to_sample"),
    ({"samples_per_insert": 1, "min_size_to_sample": 1, "error_buffer": -1}, "error_buffer"),
    ({"samples_per_insert": 1, "min_size_to_sample": 1, "error_buffer": (5.0, 1.0)}, "empty"),
    ({"samples_per_insert": 1, "min_size_to_sample": 1, "error_buffer": 5, "max_insert_size": 0},
     "max_insert_size"),
])
def test_bad_or_deadlocking_configurations_are_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RateLimiter(**kwargs)


def test_the_narrowest_accepted_window_still_moves() -> None:
    # spi=1, min size 10, window [9, 11]: diff stays in it and one side is always open.
    # A window [9.5, 10.5] would block both at diff=10 (10-1 < 9.5 and 10+1 > 10.5).
    rl = RateLimiter(1, min_size_to_sample=10, error_buffer=1)
    rl.insert(1)
    for _ in range(9):
        rl.insert(1)
    for _ in range(100):
        assert rl.can_sample() != rl.can_insert() or rl.diff == 10
        rl.sample() if rl.can_sample() else rl.insert()
    with pytest.raises(ConfigError, match="narrower"):
        RateLimiter(1, min_size_to_sample=10, error_buffer=0.5)


def test_sizes_beyond_the_declared_maxima_are_refused() -> None:
    rl = RateLimiter(1.0, min_size_to_sample=3, error_buffer=(-1e300, 1e300), max_insert_size=2,
                     max_sample_size=256)
    assert not rl.can_sample(256)
    rl.insert(2)
    rl.insert(1)
    for _ in range(1000):
        assert rl.can_sample(256)
        rl.sample(256)
    assert rl.can_insert(2)
    with pytest.raises(ConfigError, match="max_insert_size"):
        rl.can_insert(3)
    with pytest.raises(ConfigError, match="max_sample_size"):
        rl.sample(0)
