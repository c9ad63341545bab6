"""Bad input raises the documented error and leaves the buffer exactly as it was."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from shardreplay import (
    ConfigError,
    EmptyBufferError,
    Field,
    InvalidPriorityError,
    LinearSchedule,
    ReplayBuffer,
    ShardReplayError,
    Spec,
    SpecMismatchError,
    testing,
)
from shardreplay.errors import IngestRejectedError, InvalidKeyError
from tests.support.buffers import assert_same, snapshot

# Overflowing casts are the point of some cases; numpy's warning about them is expected.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

SPEC = Spec({"obs": Field((2,), np.float32), "act": Field((), np.int8),
             "count": Field((), np.uint16), "raw": Field((), np.float32, finite=False)})
S, C = 3, 5


def _step(n: int = S) -> dict[str, np.ndarray]:
    return {"obs": np.ones((n, 2), np.float32), "act": np.arange(n, dtype=np.int64),
            "count": np.arange(n, dtype=np.int64), "raw": np.zeros(n, np.float32),
            "step_type": np.ones(n, np.int64), "discount": np.ones(n, np.float32)}


@pytest.fixture
def buf() -> ReplayBuffer:
    """A prioritized buffer with data, sampled and updated once (non-trivial state)."""
    b = ReplayBuffer(SPEC, num_streams=S, stream_capacity=C, window=2, sampler="prioritized",
                     alpha=0.7, seed=0)
    for _ in range(7):  # wraps the rings
        b.add(_step())
    batch = b.sample(4)
    b.update_priorities(batch.keys, np.array([0.5, 2.0, 3.0, 0.0]))
    return b


def _raises_unchanged(b: ReplayBuffer, error: type[Exception], call: Callable[[], Any]) -> None:
    before = snapshot(b)
    with pytest.raises(error) as info:
        call()
    assert str(info.value), "an error must say what is wrong"
    assert_same(before, snapshot(b))


def _with(**changes: Any) -> dict[str, np.ndarray]:
    step = _step()
    for k, v in changes.items():
        if v is None:
            del step[k]
        else:
            step[k] = v
    return step


BAD_STEPS = {
    "missing-field": _with(act=None),
    "missing-step-type": _with(step_type=None),
    "unknown-field": _with(bogus=np.zeros(S)),
    "reserved-episode-id": _with(episode_id=np.zeros(S, np.int64)),
    "wrong-shape": _with(obs=np.ones((S, 3), np.float32)),
    "wrong-lead-shape": _with(act=np.arange(S + 1)),
    "scalar-field": _with(act=np.int64(1)),
    "float-into-int": _with(act=np.array([0.0, 1.0, 2.0])),
    "float32-into-uint16": _with(count=np.array([0.5, 1.0, 2.0], np.float32)),
    "int-overflow-int8": _with(act=np.array([0, 200, 1], np.int64)),
    "int-underflow-uint16": _with(count=np.array([0, -1, 1], np.int64)),
    "uint16-overflow": _with(count=np.array([0, 70000, 1], np.int64)),
    "nan-in-finite-field": _with(obs=np.array([[0, np.nan], [0, 0], [0, 0]], np.float32)),
    "inf-in-finite-field": _with(obs=np.array([[0, 0], [np.inf, 0], [0, 0]], np.float32)),
    "float64-overflows-float32": _with(obs=np.full((S, 2), 1e300)),
    "step-type-3": _with(step_type=np.array([0, 3, 1])),
    "step-type-negative": _with(step_type=np.array([0, -1, 1])),
    "step-type-float": _with(step_type=np.array([0.0, 1.0, 1.0])),
    "step-type-wrong-shape": _with(step_type=np.array([[0, 1, 1]])),
    "discount-above-1": _with(discount=np.array([1.0, 1.5, 1.0])),
    "discount-negative": _with(discount=np.array([1.0, -0.1, 1.0])),
    "discount-nan": _with(discount=np.array([1.0, np.nan, 1.0])),
    "discount-wrong-shape": _with(discount=np.ones(S + 1)),
}


@pytest.mark.parametrize("name", list(BAD_STEPS))
def test_bad_step_raises_spec_mismatch_and_changes_nothing(buf: ReplayBuffer, name: str) -> None:
    _raises_unchanged(buf, SpecMismatchError, lambda: buf.add(BAD_STEPS[name]))


@pytest.mark.parametrize("name", ["missing-field", "nan-in-finite-field", "int-overflow-int8",
                                  "step-type-3", "discount-nan"])
def test_bad_chunk_raises_in_extend_too(buf: ReplayBuffer, name: str) -> None:
    chunk = {k: np.stack([v, v], axis=1) for k, v in BAD_STEPS[name].items()}
    _raises_unchanged(buf, SpecMismatchError, lambda: buf.extend(chunk))


def test_bad_extend_shapes(buf: ReplayBuffer) -> None:
    _raises_unchanged(buf, SpecMismatchError, lambda: buf.extend(_step()))  # [S] not [S, T]
    long = {k: np.repeat(v[:, None], C + 1, axis=1) for k, v in _step().items()}
    _raises_unchanged(buf, SpecMismatchError, lambda: buf.extend(long))  # T > stream_capacity
    # A chunk whose last stream is bad: nothing of the good ones is written either.
    chunk = {k: np.repeat(v[:, None], 3, axis=1) for k, v in _step().items()}
    chunk["obs"][-1, -1, 0] = np.nan
    _raises_unchanged(buf, SpecMismatchError, lambda: buf.extend(chunk))


def test_integers_in_range_go_into_narrower_and_unsigned_fields(buf: ReplayBuffer) -> None:
    # Python ints arrive as int64: in range they are fine for int8 and uint16 fields.
    buf.add(_with(act=np.array([-128, 0, 127], np.int64), count=np.array([0, 65535, 7], np.int64)))
    slots = np.arange(S) * C + (testing.positions(buf) - 1) % C
    assert testing.stored(buf, "act")[slots].tolist() == [-128, 0, 127]
    assert testing.stored(buf, "count")[slots].tolist() == [0, 65535, 7]
    big = np.array([0, 2**63 + 5, 1], np.uint64)
    _raises_unchanged(buf, SpecMismatchError, lambda: buf.add(_with(act=big)))


def test_non_finite_values_are_allowed_in_a_non_finite_field(buf: ReplayBuffer) -> None:
    buf.add(_with(raw=np.array([np.nan, np.inf, -np.inf], np.float32)))
    assert np.isnan(testing.stored(buf, "raw")).any() and np.isinf(testing.stored(buf, "raw")).any()


@pytest.mark.parametrize("stream_ids", [[0, 3], [-1, 0], [0, 0], [0.0, 1.0], [[0, 1]], [], "ab"],
                         ids=["out-of-range", "negative", "duplicated", "float", "2d", "empty", "str"])
def test_bad_stream_ids(buf: ReplayBuffer, stream_ids: Any) -> None:
    n = max(len(np.asarray(stream_ids).reshape(-1)), 1)
    _raises_unchanged(buf, SpecMismatchError, lambda: buf.add(_step(n), stream_ids=stream_ids))


def test_stream_ids_that_do_not_match_the_data(buf: ReplayBuffer) -> None:
    _raises_unchanged(buf, SpecMismatchError, lambda: buf.add(_step(3), stream_ids=[0, 1]))


BAD_PRIORITIES = {"negative": [1.0, -1.0, 1.0], "nan": [1.0, np.nan, 1.0],
                  "inf": [1.0, np.inf, 1.0], "wrong-shape": [1.0, 1.0],
                  "2d": [[1.0, 1.0, 1.0]], "strings": ["a", "b", "c"]}


@pytest.mark.parametrize("name", list(BAD_PRIORITIES))
def test_bad_priorities_on_add(buf: ReplayBuffer, name: str) -> None:
    prios = np.array(BAD_PRIORITIES[name])
    _raises_unchanged(buf, InvalidPriorityError, lambda: buf.add(_step(), priorities=prios))


@pytest.mark.parametrize("bad", [-1.0, np.nan, np.inf, -np.inf, 1e300])
def test_bad_priority_in_update_changes_nothing_even_when_last(buf: ReplayBuffer, bad: float) -> None:
    keys = buf.sample(50).keys
    prios = np.linspace(0.1, 5.0, 50)
    prios[-1] = bad
    _raises_unchanged(buf, InvalidPriorityError, lambda: buf.update_priorities(keys, prios))


def test_update_with_wrong_counts(buf: ReplayBuffer) -> None:
    keys = buf.sample(4).keys
    _raises_unchanged(buf, InvalidPriorityError, lambda: buf.update_priorities(keys, [1.0] * 3))
    _raises_unchanged(buf, InvalidPriorityError, lambda: buf.update_priorities(keys, [[1.0] * 4]))


def test_keys_of_another_buffer_or_garbage(buf: ReplayBuffer) -> None:
    twin = ReplayBuffer(SPEC, num_streams=S, stream_capacity=C, window=2, sampler="prioritized", seed=0)
    for _ in range(7):  # the same writes: the same places and generations, another key tag
        twin.add(_step())
    foreign = twin.sample(5).keys.numpy()
    assert twin.info().key_tag != buf.info().key_tag
    good = buf.sample(5).keys.numpy()
    cases = {
        "another-buffers-keys": foreign,
        "place-past-the-end": np.array([(buf.info().key_tag << 39) | ((S * C) << 11) | 1], np.int64),
        "no-tag": good & ((1 << 39) - 1),
        "negative": np.array([-1], np.int64),
        "other-shard": good | np.int64(1 << 61),
        "last-of-many-garbage": np.append(good, np.int64(2**62 + 12345)),
    }
    for keys in cases.values():
        prios = np.ones(keys.shape[0])
        _raises_unchanged(buf, InvalidKeyError, lambda k=keys, p=prios: buf.update_priorities(k, p))
    for keys in (np.array([1.5, 2.0]), np.zeros((2, 2), np.int64), ["a", "b"]):
        _raises_unchanged(buf, InvalidKeyError,
                          lambda k=keys: buf.update_priorities(k, np.ones(np.shape(k)[0])))


@pytest.mark.parametrize("size", [0, -3, 2.5, "4", None])
def test_bad_batch_size(buf: ReplayBuffer, size: Any) -> None:
    _raises_unchanged(buf, ConfigError, lambda: buf.sample(size))


@pytest.mark.parametrize("sampler", ["uniform", "prioritized", "fifo"])
def test_sampling_an_empty_buffer(sampler: str) -> None:
    b = ReplayBuffer(SPEC, num_streams=2, stream_capacity=4, window=3, sampler=sampler)
    _raises_unchanged(b, EmptyBufferError, lambda: b.sample(1))
    b.add(_step(2))
    b.add(_step(2))  # two steps per stream: no window of 3 yet
    assert b.num_steps == 4 and len(b) == 0
    _raises_unchanged(b, EmptyBufferError, lambda: b.sample(1))


def test_sampling_when_every_priority_is_zero() -> None:
    b = ReplayBuffer(SPEC, num_streams=1, stream_capacity=4, window=1, sampler="prioritized",
                     alpha=0.0)
    b.add(_step(1), priorities=[0.0])
    assert len(b) == 1  # a valid start, but nothing can be drawn
    _raises_unchanged(b, EmptyBufferError, lambda: b.sample(1))


GOOD = {"num_streams": 2, "stream_capacity": 4, "window": 2}
BAD_CONFIGS = {
    "window-over-capacity": {"window": 5},
    "window-0": {"window": 0},
    "window-float": {"window": 2.0},
    "num-streams-0": {"num_streams": 0},
    "capacity-0": {"stream_capacity": 0, "window": 1},
    "unknown-sampler": {"sampler": "lifo"},
    "alpha-negative": {"sampler": "prioritized", "alpha": -0.1},
    "alpha-huge": {"sampler": "prioritized", "alpha": 11.0},
    "alpha-nan": {"sampler": "prioritized", "alpha": float("nan")},
    "alpha-none": {"sampler": "prioritized", "alpha": None},
    "alpha-string": {"sampler": "prioritized", "alpha": "0.5"},
    "beta-over-1": {"sampler": "prioritized", "beta": 1.5},
    "beta-negative": {"sampler": "prioritized", "beta": -0.1},
    "beta-schedule-over-1": {"sampler": "prioritized", "beta": LinearSchedule(0.4, 1.2, 10)},
    "beta-string": {"sampler": "prioritized", "beta": "0.4"},
    "beta-bool": {"sampler": "prioritized", "beta": True},
    "beta-nan": {"sampler": "prioritized", "beta": np.float32("nan")},
    "beta-numpy-over-1": {"sampler": "prioritized", "beta": np.float64(1.5)},
    "alpha-bool": {"sampler": "prioritized", "alpha": True},
    "shard-over-2**28-steps": {"num_streams": 1 << 14, "stream_capacity": 1 << 15},
    "device-meta": {"device": "meta"},
    "device-unknown": {"device": "tpu:0"},
    "memmap-without-directory": {"storage": "memmap"},
    "unknown-storage": {"storage": "disk"},
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_constructor_arguments(name: str) -> None:
    with pytest.raises(ConfigError):
        ReplayBuffer(SPEC, **{**GOOD, **BAD_CONFIGS[name]})


def test_bad_spec_and_schedule() -> None:
    with pytest.raises(ConfigError):
        ReplayBuffer({"obs": Field()}, **GOOD)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        LinearSchedule(0.4, 1.0, steps=0)


def test_error_types_are_the_documented_builtin_subclasses() -> None:
    for err in (ConfigError, SpecMismatchError, InvalidPriorityError, InvalidKeyError, IngestRejectedError):
        assert issubclass(err, ValueError) and issubclass(err, ShardReplayError)
    assert issubclass(EmptyBufferError, RuntimeError) and issubclass(EmptyBufferError, ShardReplayError)
