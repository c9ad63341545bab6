"""add/extend take nested dicts for nested spec names, dotted names, and torch tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardreplay import ConfigError, Field, LinearSchedule, ReplayBuffer, Spec, SpecMismatchError, testing
from tests.support.buffers import assert_same, snapshot

SPEC = Spec({"obs": {"pos": Field((3,), np.float32), "id": Field((), np.int32)},
             "act": Field((), np.int64)})


def _buffer(**kwargs) -> ReplayBuffer:
    return ReplayBuffer(SPEC, num_streams=2, stream_capacity=6, window=2, seed=0, **kwargs)


def _all_windows(buf: ReplayBuffer) -> dict[int, dict[str, list]]:
    batch = buf.sample(200)
    out = {}
    for b in range(len(batch)):
        out[int(batch.data["act"][b, 0])] = {k: v[b].tolist() for k, v in batch.data.items()}
    return out


def test_nested_dict_of_torch_tensors_and_dotted_numpy_give_the_same_buffer() -> None:
    nested, dotted = _buffer(), _buffer()
    for t in range(3):
        pos = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * t
        nested.add({"obs": {"pos": pos, "id": torch.tensor([7, 8], dtype=torch.int32)},
                    "act": torch.tensor([t, 100 + t]), "step_type": torch.tensor([min(t, 1)] * 2),
                    "discount": torch.ones(2)})
        dotted.add({"obs.pos": pos.numpy(), "obs.id": np.array([7, 8], np.int32),
                    "act": np.array([t, 100 + t]), "step_type": np.array([min(t, 1)] * 2)})
    windows = _all_windows(nested)
    assert windows == _all_windows(dotted)
    assert sorted(windows) == [0, 1, 100, 101]
    assert windows[1]["obs.pos"] == [[10.0, 11.0, 12.0], [20.0, 21.0, 22.0]]
    assert windows[101]["obs.id"] == [8, 8]
    batch = nested.sample(2)
    assert set(batch.data) == {"obs.pos", "obs.id", "act", "step_type", "discount", "episode_id"}
    assert batch.data["obs.pos"].shape == (2, 2, 3) and batch.data["obs.pos"].dtype == torch.float32


def test_extend_with_torch_chunk_stream_ids_and_priorities() -> None:
    buf = _buffer(sampler="prioritized", alpha=1.0)
    t_len = 4
    chunk = {"obs": {"pos": torch.zeros(1, t_len, 3), "id": torch.zeros(1, t_len, dtype=torch.int32)},
             "act": torch.arange(t_len).view(1, t_len),
             "step_type": torch.tensor([[0, 1, 1, 2]], dtype=torch.uint8)}
    buf.extend(chunk, stream_ids=torch.tensor([1]), priorities=torch.tensor([[1.0, 3.0, 0.0, 2.0]]))
    assert testing.positions(buf).tolist() == [0, 4]
    batch = buf.sample(300)
    acts = batch.data["act"][:, 0]
    assert set(acts.tolist()) == {0, 1}  # start 2 has priority 0; 3 is LAST
    np.testing.assert_allclose(batch.probabilities.numpy(), np.where(acts.numpy() == 0, 0.25, 0.75))
    # Priorities and keys as torch tensors in update_priorities too.
    assert buf.update_priorities(batch.keys[:2], torch.tensor([5.0, 5.0])) == 2


def test_partly_nested_input_with_a_wrong_leaf_is_refused() -> None:
    buf = _buffer()
    with pytest.raises(SpecMismatchError):
        buf.add({"obs": {"pos": torch.zeros(2, 3), "idd": torch.zeros(2)}, "act": torch.zeros(2),
                 "step_type": torch.zeros(2, dtype=torch.int64)})
    with pytest.raises(SpecMismatchError):  # float tensor into an int field
        buf.add({"obs": {"pos": torch.zeros(2, 3), "id": torch.zeros(2)}, "act": torch.zeros(2),
                 "step_type": torch.zeros(2, dtype=torch.int64)})
    assert buf.num_steps == 0


@pytest.mark.parametrize("sampler", ["uniform", "prioritized", "fifo"])
def test_an_empty_chunk_is_checked_and_changes_nothing(sampler: str) -> None:
    buf = _buffer(sampler=sampler)
    buf.extend({"obs.pos": np.zeros((2, 3, 3)), "obs.id": np.zeros((2, 3), np.int32),
                "act": np.arange(6).reshape(2, 3), "step_type": np.ones((2, 3), np.int64)})
    before = snapshot(buf)
    empty = {"obs.pos": np.zeros((2, 0, 3)), "obs.id": np.zeros((2, 0), np.int32),
             "act": np.zeros((2, 0), np.int64), "step_type": np.ones((2, 0), np.int64)}
    buf.extend(empty)
    buf.extend({k: v[1:] for k, v in empty.items()}, stream_ids=[1], priorities=np.zeros((1, 0)))
    assert_same(before, snapshot(buf))
    with pytest.raises(SpecMismatchError):  # still validated: a wrong field shape is refused
        buf.extend({**empty, "obs.pos": np.zeros((2, 0, 4))})


def test_extend_stores_every_field_size_from_strided_and_contiguous_inputs() -> None:
    """The compiled one-call write of all fields: sizes of 0, 1, 2, 3, 4, 8 and 40+ bytes
    per step (record fields and big fields), from C-contiguous, Fortran-ordered and
    strided inputs, land in the right slots of scattered rows."""
    spec = Spec({"u8": Field((), np.uint8), "f16": Field((), np.float16), "rgb": Field((3,), np.uint8),
                 "i32": Field((), np.int32), "f64": Field((), np.float64), "big": Field((5, 3), np.float32),
                 "none": Field((0,), np.float32), "be": Field((2,), np.dtype(">i4")),
                 "f128": Field((), np.longdouble)})
    buf = ReplayBuffer(spec, num_streams=5, stream_capacity=8, window=1, seed=0)
    rng = np.random.default_rng(0)
    rows, s, t = np.array([3, 0, 4]), 3, 4
    values = {name: rng.integers(0, 200, (s, t, *f.shape)).astype(f.dtype) for name, f in spec.fields.items()}
    given = dict(values)
    given["big"] = np.asfortranarray(values["big"])                        # not C-contiguous
    given["i32"] = np.repeat(values["i32"], 2, axis=1)[:, ::2]             # strided
    types = np.ones((s, t), np.uint8)
    types[:, 0] = 0
    buf.extend({**given, "step_type": types}, stream_ids=rows)
    assert not given["big"].flags.c_contiguous and not given["i32"].flags.c_contiguous
    slots = (rows[:, None] * 8 + np.arange(t)).ravel()
    stored, _mask, _keys = testing.shard(buf).gather(slots)
    for name, expected in values.items():
        np.testing.assert_array_equal(stored[name][:, 0], expected.reshape(s * t, *expected.shape[2:]), name)
    untouched = np.setdiff1d(np.arange(40), slots)
    stored, _mask, _keys = testing.shard(buf).gather(untouched)
    assert not stored["big"].any() and not stored["f64"].any()


@pytest.mark.parametrize("beta", [np.float32(0.4), np.float64(0.4), np.float16(0.4)])
def test_numpy_scalar_alpha_and_beta_are_numbers(beta: np.floating) -> None:
    buf = _buffer(sampler="prioritized", alpha=np.float32(0.6), beta=beta)
    assert testing.sampler_counters(buf)["beta"] == pytest.approx(float(beta))
    schedule = LinearSchedule(np.float32(0.4), np.float64(1.0), np.int64(10))
    scheduled = _buffer(sampler="prioritized", beta=schedule)
    assert testing.sampler_counters(scheduled)["beta"] == pytest.approx(0.4)


@pytest.mark.parametrize(("beta", "says"), [(True, "bool"), (np.bool_(False), "bool"),
                                            (np.float32("nan"), "NaN"), (float("nan"), "NaN"),
                                            ("0.4", "str")])
def test_bool_nan_and_text_beta_are_refused_with_one_line(beta: object, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        _buffer(sampler="prioritized", beta=beta)
    message = str(info.value)
    assert "\n" not in message and message.startswith("beta must be a number in [0.0, 1.0]")
    assert says in message
