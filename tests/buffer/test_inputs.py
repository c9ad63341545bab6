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


# -- every natural input: converted once, stored as the typed input, on the short path -----

NATURAL_SPEC = Spec({"obs": Field((3,), np.float32), "action": Field((), np.int64),
                     "count": Field((), np.int32), "reward": Field((), np.float32)})


def _typed_steps(envs: int, n: int = 6) -> list[dict[str, np.ndarray]]:
    """``n`` typed steps of ``envs`` streams: FIRST, MID..., LAST (with a discount 0 at LAST)."""
    rng = np.random.default_rng(1)
    steps = []
    for t in range(n):
        kind = 0 if t == 0 else (2 if t == n - 1 else 1)
        steps.append({"obs": rng.standard_normal((envs, 3)).astype(np.float32),
                      "action": rng.integers(0, 5, envs), "count": rng.integers(-9, 9, envs).astype(np.int32),
                      "reward": rng.standard_normal(envs).astype(np.float32),
                      "step_type": np.full(envs, kind, np.uint8),
                      "discount": np.full(envs, 0.0 if kind == 2 else 1.0, np.float32)})
    return steps


def _observed(buf: ReplayBuffer) -> dict[str, object]:
    """What can be seen of a buffer, less its key tag (each buffer draws its own)."""
    snap = snapshot(buf)
    snap["state"]["meta"].pop("key_tag", None)
    return snap


def _scalars(step: dict[str, np.ndarray]) -> dict[str, object]:
    return {k: (v[0].tolist() if v.ndim > 1 else v.item()) for k, v in step.items()}


NATURAL_KINDS = {
    "int64_step_types": lambda s: {**s, "step_type": s["step_type"].astype(np.int64)},
    "uint64_step_types": lambda s: {**s, "step_type": s["step_type"].astype(np.uint64)},
    "int8_step_types": lambda s: {**s, "step_type": s["step_type"].astype(np.int8)},
    "int_fields_of_other_dtypes": lambda s: {**s, "action": s["action"].astype(np.uint8),
                                             "count": s["count"].astype(np.int64)},
    "float64": lambda s: {**s, "obs": s["obs"].astype(np.float64), "reward": s["reward"].astype(np.float64)},
    "bool_discount": lambda s: {**s, "discount": s["discount"].astype(bool)},
    "float64_discount": lambda s: {**s, "discount": s["discount"].astype(np.float64)},
    "strided": lambda s: {**s, "obs": np.repeat(s["obs"], 2, axis=-1)[..., ::2],
                          "reward": np.repeat(s["reward"], 2, axis=-1)[..., ::2]},
    "fortran": lambda s: {**s, "obs": np.asfortranarray(s["obs"])},
    "read_only": lambda s: {k: np.frombuffer(v.tobytes(), v.dtype).reshape(v.shape) for k, v in s.items()},
    "lists": lambda s: {k: v.tolist() for k, v in s.items()},
    "torch": lambda s: {k: torch.from_numpy(v.copy()) for k, v in s.items()},
    "torch_requires_grad": lambda s: {**s, "obs": torch.from_numpy(s["obs"].copy()).requires_grad_()},
}


def _filled(steps: list[dict[str, object]], envs: int, short_path: bool) -> ReplayBuffer:
    buf = ReplayBuffer(NATURAL_SPEC, num_streams=envs, stream_capacity=8, window=2, seed=0)
    if short_path:
        shard = testing.shard(buf)
        assert shard.use_one_step()

        def no_full_path(*args: object) -> None:
            raise AssertionError("a natural input fell back to the full validation")
        shard.write_full = no_full_path  # type: ignore[method-assign]
    for step in steps:
        buf.add(step)
    return buf


@pytest.mark.parametrize("kind", sorted(NATURAL_KINDS))
@pytest.mark.parametrize("envs", [1, 3])
def test_natural_inputs_take_the_short_path_and_store_what_typed_inputs_store(kind: str, envs: int) -> None:
    """Each kind is converted before the compiled write (the full validation would raise
    here) and the buffer then holds exactly what the typed steps give."""
    typed = _typed_steps(envs)
    expected = _observed(_filled(typed, envs, short_path=False))
    got = _filled([NATURAL_KINDS[kind](s) for s in typed], envs, short_path=True)
    assert_same(expected, _observed(got))
    full = _filled([NATURAL_KINDS[kind](s) for s in typed], envs, short_path=False)
    assert_same(expected, _observed(full))  # the full validation converts the same way


def test_python_scalars_of_one_env_take_the_short_path() -> None:
    typed = _typed_steps(1)
    got = _filled([_scalars(s) for s in typed], 1, short_path=True)
    assert_same(_observed(_filled(typed, 1, short_path=False)), _observed(got))
    assert _scalars(typed[1])["step_type"] == 1  # plain ints, as StepType.MID is


@pytest.mark.parametrize("kind", sorted(NATURAL_KINDS))
def test_natural_chunks_store_what_typed_chunks_store(kind: str) -> None:
    typed = _typed_steps(2)
    chunk = {k: np.stack([s[k] for s in typed], axis=1) for k in typed[0]}
    expected, got = _buffer_for_chunks(), _buffer_for_chunks()
    expected.extend(chunk)
    got.extend(NATURAL_KINDS[kind](chunk))
    assert_same(_observed(expected), _observed(got))


def _buffer_for_chunks() -> ReplayBuffer:
    return ReplayBuffer(NATURAL_SPEC, num_streams=2, stream_capacity=8, window=2, seed=0)


BAD_INPUTS = {
    "step type 300": (lambda s: {**s, "step_type": np.full(2, 300)}, "values must be FIRST=0"),
    "step type -1": (lambda s: {**s, "step_type": np.full(2, -1, np.int8)}, "values must be FIRST=0"),
    "step type 3": (lambda s: {**s, "step_type": [3, 1]}, "values must be FIRST=0"),
    "float step types": (lambda s: {**s, "step_type": np.ones(2)}, "expected integers"),
    "count out of int32": (lambda s: {**s, "count": np.full(2, 2**40)}, "outside the range of int32"),
    "uint64 beyond int64": (lambda s: {**s, "action": np.full(2, 2**63, np.uint64)},
                            "outside the range of int64"),
    "float action": (lambda s: {**s, "action": np.ones(2)}, "cannot cast float64 to int64"),
    "short obs": (lambda s: {**s, "obs": s["obs"][:, :2]}, "expected shape"),
    "obs list of 2 rows of 2": (lambda s: {**s, "obs": [[0.0, 1.0], [2.0, 3.0]]}, "expected shape"),
    "torch obs of 3 rows": (lambda s: {**s, "obs": torch.zeros(3, 3)}, "expected shape"),
    "discount 2": (lambda s: {**s, "discount": np.full(2, 2.0)}, "field 'discount'"),
    "text": (lambda s: {**s, "reward": ["a", "b"]}, "cannot cast"),
}


@pytest.mark.parametrize("bad", sorted(BAD_INPUTS))
@pytest.mark.parametrize("short_path", [True, False])
def test_inputs_that_cannot_be_stored_are_refused_in_one_line_with_nothing_stored(bad: str,
                                                                                  short_path: bool) -> None:
    buf = ReplayBuffer(NATURAL_SPEC, num_streams=2, stream_capacity=8, window=2, seed=0)
    testing.shard(buf).use_one_step(short_path)
    typed = _typed_steps(2)
    buf.add(typed[0])
    before = _observed(buf)
    make, says = BAD_INPUTS[bad]
    with pytest.raises(SpecMismatchError) as info:
        buf.add(make(typed[1]))
    assert says in str(info.value) and "\n" not in str(info.value)
    assert_same(before, _observed(buf))
    with pytest.raises(SpecMismatchError):  # a chunk of it too (a time axis of 1)
        buf.extend({k: np.asarray(v)[:, None] for k, v in make(typed[1]).items()})
    assert_same(before, _observed(buf))


def test_add_of_a_collectors_time_major_tensordict_is_refused_in_one_line() -> None:
    tensordict = pytest.importorskip("tensordict")
    spec = Spec({"obs": Field((4,), np.float32), "action": Field((), np.int64),
                 "reward": Field((), np.float32)})
    buf = ReplayBuffer(spec, num_streams=1, stream_capacity=32, window=2, seed=0)
    t = 10
    obs = torch.arange(4 * (t + 1), dtype=torch.float32).view(t + 1, 4)
    td = tensordict.TensorDict({
        "observation": obs[:-1], "action": torch.zeros(t, dtype=torch.int64),
        "next": {"observation": obs[1:], "reward": torch.zeros(t, 1),
                 "terminated": torch.zeros(t, 1, dtype=torch.bool),
                 "truncated": torch.zeros(t, 1, dtype=torch.bool)}}, batch_size=[t])
    with pytest.raises(SpecMismatchError, match=r"extend\(td.unsqueeze\(0\)\)") as info:
        buf.add(td)
    assert "\n" not in str(info.value) and buf.num_steps == 0
    buf.extend(td.unsqueeze(0))  # what the message says
    assert buf.num_steps == t
