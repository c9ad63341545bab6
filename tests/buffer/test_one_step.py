"""The short path of ``ReplayBuffer.add`` for one step (storage/one_step.py) stores
exactly what the full path stores, raises the same errors for bad input, and writes
nothing then: two buffers, one taking the short path and one the full path, get the same
stream of steps (good ones, unusual ones that the full path converts, bad ones) and must
agree after every call.

Cost: ~20-40 s on the 2-core CI machine the first time (one kernel compiled per spec,
then loaded from numba's cache), a few seconds after.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import shardreplay as sr
import shardreplay.kernels.add_step as kernel
import shardreplay.spec.coerce as coerce
import shardreplay.spec.validation as validation
import shardreplay.storage.one_step as one_step
from shardreplay import testing
from shardreplay.buffer import shard as shard_module
from tests.support.buffers import assert_same, snapshot

# One worker for the whole module: its cases compile the same specialised kernels, which
# several workers would otherwise compile at once on a cold numba cache (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("one-step-kernels")

SPECS = {
    "vector": sr.Spec({"obs": sr.Field((4,), np.float32), "action": sr.Field((), np.int64),
                       "reward": sr.Field((), np.float32)}),
    "float": sr.Spec({"obs": sr.Field((3,), np.float32), "action": sr.Field((1,), np.float32),
                      "reward": sr.Field((), np.float32)}),
    # Nested names, fields of their own array (more than 32 bytes per step), a field that
    # may hold NaN, unsigned and narrow integers, float64.
    "mixed": sr.Spec({"obs": {"grid": sr.Field((2, 3), np.float64), "wide": sr.Field((17,), np.float32)},
                      "flags": sr.Field((5,), np.uint8), "action": sr.Field((), np.int32),
                      "reward": sr.Field((), np.float32, finite=False)}),
}


def _pair(spec: sr.Spec, streams: int, sampler: str) -> tuple[sr.ReplayBuffer, sr.ReplayBuffer]:
    """A buffer on the short path and one on the full path, alike otherwise."""
    kw: dict[str, Any] = {"num_streams": streams, "stream_capacity": 6, "window": 3, "sampler": sampler,
                          "seed": 11}
    fast, full = sr.ReplayBuffer(spec, **kw), sr.ReplayBuffer(spec, **kw)
    assert testing.shard(fast).use_one_step()
    assert not testing.shard(full).use_one_step(False)
    return fast, full


def _good(spec: sr.Spec, streams: int, rng: np.random.Generator) -> dict[str, Any]:
    """A step in the stored dtypes (the short path's kind of input)."""
    step: dict[str, Any] = {}
    for name, f in spec.fields.items():
        if f.dtype.kind == "f":
            step[name] = rng.standard_normal((streams, *f.shape)).astype(f.dtype)
        else:
            step[name] = rng.integers(0, 100, (streams, *f.shape)).astype(f.dtype)
    step["step_type"] = rng.integers(0, 3, streams).astype(np.uint8)
    if rng.random() < 0.3:
        step["discount"] = rng.choice([0.0, 0.5, 1.0], streams).astype(np.float32)
    return step


def _float_field(spec: sr.Spec) -> str:
    return next(n for n, f in spec.fields.items() if f.dtype.kind == "f" and f.finite)


def _int_field(spec: sr.Spec) -> str:
    return next((n for n, f in spec.fields.items() if f.dtype.kind in "iu"), spec.names[0])


def _nan(step: dict[str, Any], spec: sr.Spec) -> None:
    name = _float_field(spec)
    step[name] = step[name].copy()
    step[name].reshape(-1)[-1] = np.nan


def _inf_where_allowed(step: dict[str, Any], spec: sr.Spec) -> None:
    for name, f in spec.fields.items():
        if not f.finite:
            step[name] = np.full_like(step[name], np.inf)


def _nested(step: dict[str, Any], spec: sr.Spec) -> None:
    for name in [n for n in step if "." in n]:
        head, tail = name.split(".", 1)
        step.setdefault(head, {})[tail] = step.pop(name)


# Each turns a good step into an unusual one (stored after a conversion) or a bad one.
MUTATIONS: dict[str, Callable[[dict[str, Any], sr.Spec], None]] = {
    "nan": _nan,
    "inf where allowed": _inf_where_allowed,
    "step type 3": lambda s, spec: s.__setitem__("step_type", np.full_like(s["step_type"], 3)),
    "step type int64": lambda s, spec: s.__setitem__("step_type", s["step_type"].astype(np.int64)),
    "step type list": lambda s, spec: s.__setitem__("step_type", s["step_type"].tolist()),
    "discount 1.5": lambda s, spec: s.__setitem__("discount", np.full(len(s["step_type"]), 1.5, np.float32)),
    "discount nan": lambda s, spec: s.__setitem__("discount",
                                                  np.full(len(s["step_type"]), np.nan, np.float32)),
    "discount float64": lambda s, spec: s.__setitem__("discount", np.full(len(s["step_type"]), 0.25)),
    "discount None": lambda s, spec: s.__setitem__("discount", None),
    "discount of other rows": lambda s, spec: s.__setitem__("discount", np.ones(len(s["step_type"]) + 1,
                                                                                 np.float32)),
    "extra row": lambda s, spec: s.__setitem__(spec.names[0], np.concatenate([s[spec.names[0]]] * 2)),
    "field shape": lambda s, spec: s.__setitem__(spec.names[0], s[spec.names[0]][..., None]),
    "step types of other rows": lambda s, spec: s.__setitem__("step_type", np.zeros(len(s["step_type"]) + 1,
                                                                                      np.uint8)),
    "unit axis left out": lambda s, spec: [s.__setitem__(n, s[n][..., 0]) for n, f in spec.fields.items()
                                           if f.shape[-1:] == (1,)],
    "float64 values": lambda s, spec: s.__setitem__(_float_field(spec),
                                                    s[_float_field(spec)].astype(np.float64)),
    "floats into an integer field": lambda s, spec: s.__setitem__(_int_field(spec),
                                                                  s[_int_field(spec)].astype(np.float32)),
    "int16 values": lambda s, spec: s.__setitem__(_int_field(spec), s[_int_field(spec)].astype(np.int16)),
    "out of range integers": lambda s, spec: s.__setitem__(_int_field(spec),
                                                           s[_int_field(spec)].astype(np.int64) + 2**40),
    "strided values": lambda s, spec: s.__setitem__(spec.names[0], np.repeat(s[spec.names[0]], 2, 0)[::2]),
    "torch values": lambda s, spec: s.__setitem__(spec.names[0], torch.from_numpy(s[spec.names[0]])),
    "read-only values": lambda s, spec: s[spec.names[0]].setflags(write=False),
    "missing field": lambda s, spec: s.pop(spec.names[-1]),
    "missing step type": lambda s, spec: s.pop("step_type"),
    "unknown field": lambda s, spec: s.__setitem__("bogus", np.zeros(1)),
    "nested": _nested,
}


def _as_chunk(value: Any) -> Any:
    """A step's value with a time axis of one step (``[S, 1, ...]``), for ``extend``."""
    if isinstance(value, dict):
        return {k: _as_chunk(v) for k, v in value.items()}
    if isinstance(value, np.ndarray | torch.Tensor):
        return value[:, None]
    return [[x] for x in value] if isinstance(value, list) else value


def _call(buf: sr.ReplayBuffer, step: dict[str, Any], entry: str = "add") -> str | None:
    try:
        if entry == "add":
            buf.add(step)
        else:
            buf.extend({k: _as_chunk(v) for k, v in step.items()})
    except Exception as exc:  # the type and message are what is compared
        return f"{type(exc).__name__}: {exc}"
    return None


def _observed(buf: sr.ReplayBuffer) -> dict[str, Any]:
    """What can be seen of a buffer, less its key tag (each buffer draws its own)."""
    snap = snapshot(buf)
    snap["state"]["meta"].pop("key_tag", None)
    return snap


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["add", "extend"], ids=["add", "extend of one step"])
@pytest.mark.parametrize("sampler", ["uniform", "prioritized", "fifo"])
@pytest.mark.parametrize("streams", [1, 3])
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_short_path_stores_and_raises_as_the_full_path(kind: str, streams: int, sampler: str,
                                                       entry: str) -> None:
    """``add`` and ``extend`` of one step per stream both take the one-step writer."""
    spec = SPECS[kind]
    fast, full = _pair(spec, streams, sampler)
    rng = np.random.default_rng([streams, len(kind), len(sampler)])
    names = sorted(MUTATIONS)
    seen_errors = 0
    short = testing.shard(fast)._one_step
    assert short is not None
    taken: list[bool] = []
    take = short.add
    short.add = lambda step: taken.append(take(step)) or taken[-1]  # type: ignore[method-assign]
    for i in range(120):
        step = _good(spec, streams, rng)
        if i % 3 == 0:
            MUTATIONS[names[(i // 3) % len(names)]](step, spec)
        before = _observed(fast)
        error = _call(fast, {k: v for k, v in step.items()}, entry)
        assert error == _call(full, step, entry), f"step {i}: {step}"
        if error is not None:
            seen_errors += 1
            assert_same(_observed(fast), before, f"step {i} wrote before raising {error}")
        assert_same(_observed(fast), _observed(full), f"step {i}")
        if sampler == "prioritized" and i % 7 == 6 and len(full):
            keys = full.sample(2).keys
            prios = rng.random(2) * 4
            fast.update_priorities(fast.sample(2).keys, prios)
            full.update_priorities(keys, prios)
    assert seen_errors >= 15
    assert sum(taken) >= 70  # the good steps went the short way
    if len(full):
        a, b = fast.sample(5), full.sample(5)
        assert_same(a.data, b.data)
        assert_same(a.mask, b.mask)


def test_a_step_in_the_stored_dtypes_takes_one_compiled_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The short path does not go through Spec.validate, also for inputs it converts
    first; the full path still does for the rest (and says what is wrong)."""
    buf = sr.ReplayBuffer(SPECS["vector"], num_streams=2, stream_capacity=8, seed=0)
    assert testing.shard(buf).use_one_step()
    calls: list[int] = []
    full_check = validation.validate
    monkeypatch.setattr(validation, "validate", lambda *a: calls.append(1) or full_check(*a))
    step = _good(SPECS["vector"], 2, np.random.default_rng(0))
    step.pop("discount", None)
    step["step_type"] = np.array([0, 0], np.uint8)
    buf.add(step)
    assert calls == [] and buf.num_steps == 2
    buf.add({**step, "step_type": [1, 1]})  # a list: converted, then the short path
    assert calls == [] and buf.num_steps == 4
    with pytest.raises(sr.SpecMismatchError, match="expected shape"):  # the full path says why
        buf.add({**step, "obs": step["obs"][:, :3]})
    assert calls == [1] and buf.num_steps == 4
    np.testing.assert_array_equal(testing.stored(buf, "obs")[[0, 8]], step["obs"])


def test_steps_in_the_stored_form_go_straight_to_the_kernel() -> None:
    """Steps in the stored dtypes go to the kernel as they come, also right after a list
    step (whose values are read as numpy first, the places remembered); each stores what
    the full path stores."""
    fast, full = _pair(SPECS["vector"], 2, "uniform")
    short = testing.shard(fast)._one_step
    assert short is not None
    step = _good(SPECS["vector"], 2, np.random.default_rng(1))
    step.pop("discount", None)
    step["step_type"] = np.array([0, 1], np.uint8)
    natural = {**step, "action": step["action"].tolist()}
    kinds = ((step, ()), (step, ()), (natural, (3,)), (step, ()), (natural, (3,)), (natural, (3,)))
    for given, read in kinds:
        fast.add(given)
        full.add(given)
        assert tuple(place for place, *_ in short._reads[0]) == read
        assert (short._taken[3] is step["action"]) == (given is step)  # the action's place
        assert_same(_observed(fast), _observed(full))


def _counted_casts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every Python cast to a stored dtype (``spec/coerce.as_stored``) outside the full
    validation, by field name."""
    casts: list[str] = []
    for module in (coerce,):
        def counted(name: str, *args: Any, _cast: Any = module.as_stored, **kwargs: Any) -> np.ndarray:
            casts.append(name)
            return _cast(name, *args, **kwargs)
        monkeypatch.setattr(module, "as_stored", counted)
    return casts


# Each kind, from a step in the stored form.
NATURAL_KINDS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "int64 step types": lambda st: {**st, "step_type": st["step_type"].astype(np.int64)},
    "float64": lambda st: {**st, "obs": st["obs"].astype(np.float64), "reward": st["reward"].astype(float)},
    "int32 action": lambda st: {**st, "action": st["action"].astype(np.int32)},
    "strided": lambda st: {**st, "obs": np.repeat(st["obs"], 2, axis=-1)[..., ::2]},
    "lists": lambda st: {k: v.tolist() for k, v in st.items()},
    "torch": lambda st: {k: torch.from_numpy(v.copy()) for k, v in st.items()},
    "bool discount": lambda st: {**st, "discount": st["step_type"] != 2},
    "int discount": lambda st: {**st, "discount": (st["step_type"] != 2).astype(np.int64)},
}


@pytest.mark.parametrize("kind", NATURAL_KINDS)
def test_natural_inputs_are_converted_once_for_the_one_compiled_kernel(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Numpy arrays of another dtype or layout, lists, tensors and bool or integer
    discounts take the short path with no cast in Python (``as_stored`` is never called): the
    kernel stores each value in the field's dtype, in one more compiled form (a list or a
    tensor is read as numpy first). Each step stores what the full path stores, and a value
    that cannot be stored is refused with the full path's one-line error, nothing written."""
    fast, full = _pair(SPECS["vector"], 2, "uniform")
    short = testing.shard(fast)._one_step
    assert short is not None
    casts = _counted_casts(monkeypatch)
    rng = np.random.default_rng(3)
    natural = NATURAL_KINDS[kind]
    for t in range(6):
        step = _good(SPECS["vector"], 2, rng)
        step.pop("discount", None)
        step["step_type"] = np.array([t % 3, 1], np.uint8)
        given = natural(step)
        assert short.add(given)  # the short path took it
        full.add(given)
        assert_same(_observed(fast), _observed(full))
        assert casts == []
    assert len(short._kernels[0].forms) == (1 if kind == "torch" else 2)  # torch: the stored dtypes
    bad = {**given, "action": np.full(2, 1.5)} if kind != "int64 step types" else \
        {**given, "step_type": np.array([1, 300])}
    before = snapshot(fast)
    with pytest.raises(sr.SpecMismatchError) as info:
        fast.add(bad)
    assert "\n" not in str(info.value)
    assert_same(snapshot(fast), before)


@pytest.mark.parametrize("kind", ["int64 arrays", "lists", "python ints", "int64 tensors"])
def test_integers_are_range_checked_by_the_kernel(kind: str) -> None:
    """Integers into a uint8 field go to the kernel as int64 (no as_stored), which checks
    their range: a value out of range is refused with the full path's error, nothing written."""
    spec = sr.Spec({"obs": sr.Field((), np.uint8), "reward": sr.Field((), np.float32)})
    fast, full = _pair(spec, 1, "uniform")
    short = testing.shard(fast)._one_step
    assert short is not None
    given = {"int64 arrays": lambda v: np.array([v]), "lists": lambda v: [v], "python ints": int,
             "int64 tensors": lambda v: torch.tensor([v])}[kind]
    for t in range(3):
        step = {"obs": given(255 - t), "reward": np.zeros(1, np.float32),
                "step_type": np.array([min(t, 1)], np.uint8)}
        assert short.add(step)
        full.add(step)
        assert_same(_observed(fast), _observed(full))
        assert short._taken[2].dtype == np.int64 and len(short._kernels[0].forms) == 2
    before = snapshot(fast)
    for bad in (256, -1):
        with pytest.raises(sr.SpecMismatchError, match="outside the range"):
            fast.add({**step, "obs": given(bad)})
        assert_same(snapshot(fast), before)
    if kind != "python ints":  # one value of another shape: refused, as the full path refuses it
        with pytest.raises(sr.SpecMismatchError, match="expected shape"):
            fast.add({**step, "obs": [[7]] if kind == "lists" else given(7)[None]})
        assert_same(snapshot(fast), before)


def test_a_kind_seen_before_takes_its_form_without_typing_the_values_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Kinds that alternate (as steps at episode ends may) switch to a form the writer has,
    trying each (a wrong one refuses at once): numba types the values once per new kind."""
    typed: list[int] = []
    form_for = kernel.form_for
    # On the writer's own reference (a lazy module, which keeps what it read).
    monkeypatch.setattr(one_step.kernel, "form_for", lambda *a: typed.append(1) or form_for(*a))
    fast, full = _pair(SPECS["vector"], 2, "uniform")
    short = testing.shard(fast)._one_step
    assert short is not None
    rng = np.random.default_rng(6)
    kinds = [NATURAL_KINDS["int64 step types"], NATURAL_KINDS["float64"], lambda st: st]
    for t in range(12):
        step = _good(SPECS["vector"], 2, rng)
        step.pop("discount", None)
        step["step_type"] = np.array([t % 3, 1], np.uint8)
        given = kinds[t % 3](step)
        assert short.add(given)
        full.add(given)
        assert_same(_observed(fast), _observed(full))
    assert len(typed) == 2 and len(short._kernels[0].forms) == 3  # the stored form's was made first


@pytest.mark.parametrize("max_forms", [8, 3])
def test_every_kind_of_input_in_turn_stores_what_the_full_path_stores(
        max_forms: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole matrix of kinds through one writer, in turn: each step stores what the full
    path stores. The kernel compiles a form per kind up to ``MAX_FORMS`` and takes those
    kinds with no cast in Python; kinds beyond it go to the full path."""
    monkeypatch.setattr(kernel, "MAX_FORMS", max_forms)
    fast, full = _pair(SPECS["vector"], 2, "uniform")
    short = testing.shard(fast)._one_step
    assert short is not None
    rng = np.random.default_rng(4)
    kinds = list(NATURAL_KINDS.values())
    taken = []
    for t in range(3 * len(kinds)):
        step = _good(SPECS["vector"], 2, rng)
        step.pop("discount", None)
        step["step_type"] = np.array([t % 3, 1], np.uint8)
        given = kinds[t % len(kinds)](step)
        taken.append(short.add(given))
        if not taken[-1]:
            fast.add(given)  # the full path
        full.add(given)
        assert_same(_observed(fast), _observed(full))
    assert len(short._kernels[0].forms) == max_forms
    # The 8 kinds of NATURAL_KINDS make 8 forms (torch's is the stored one); with 3, the
    # stored form's and those of the first two kinds (int64 step types, float64).
    want = [True] * len(kinds) if max_forms == 8 else [True, True, False, False, False, True, False, False]
    assert taken == want * 3


def test_the_short_path_is_built_after_many_one_step_adds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_module, "ONE_STEP_AFTER", 3)
    step = {"obs": np.zeros((1, 4), np.float32), "action": np.zeros(1, np.int64),
            "reward": np.zeros(1, np.float32), "step_type": np.zeros(1, np.uint8)}
    buf = sr.ReplayBuffer(SPECS["vector"], num_streams=1, stream_capacity=8)
    for _ in range(4):
        assert testing.shard(buf)._one_step is None
        buf.add(step)
    assert testing.shard(buf)._one_step is not None
    buf.add(step)
    assert buf.num_steps == 5


PIXELS = sr.Spec({"obs": sr.Field((3, 2, 4), np.uint8, frame_stack=True), "action": sr.Field((), np.int64),
                  "reward": sr.Field((), np.float32)})


def _stacked_step(last: np.ndarray, streams: int, rng: np.random.Generator) -> dict[str, Any]:
    """A step whose stacks mostly continue ``last`` (the stacks last stored), sometimes
    not (refused unless the step is FIRST), in the stored dtypes or not."""
    frames = rng.integers(0, 4, (streams, 1, 2, 4)).astype(np.uint8)
    obs = np.concatenate([last[:, 1:], frames], axis=1)
    roll = rng.random()
    if roll < 0.1:
        obs = rng.integers(0, 4, obs.shape).astype(np.uint8)  # continues nothing
    step: dict[str, Any] = {"obs": obs, "action": rng.integers(0, 4, streams),
                            "reward": rng.standard_normal(streams).astype(np.float32),
                            "step_type": rng.choice([0, 1, 1, 1, 2], streams).astype(np.uint8)}
    if 0.1 <= roll < 0.15:
        step["obs"] = obs.astype(np.int64)  # converted by the full path
    elif 0.15 <= roll < 0.2:
        step["reward"] = np.full(streams, np.nan, np.float32)
    elif 0.2 <= roll < 0.25:
        step["obs"] = obs[..., None]  # wrong shape
    elif 0.25 <= roll < 0.3:
        step["discount"] = np.zeros(streams, np.float32)
    return step


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
@pytest.mark.parametrize("streams", [1, 2])
def test_short_path_with_frame_stacks_stores_and_raises_as_the_full_path(streams: int, sampler: str) -> None:
    fast, full = _pair(PIXELS, streams, sampler)
    rng = np.random.default_rng([streams, len(sampler)])
    last = rng.integers(0, 4, (streams, 3, 2, 4)).astype(np.uint8)
    errors = 0
    short = testing.shard(fast)._one_step
    assert short is not None
    taken: list[bool] = []
    take = short.add
    short.add = lambda step: taken.append(take(step)) or taken[-1]  # type: ignore[method-assign]
    for i in range(100):
        step = _stacked_step(last, streams, rng)
        before = _observed(fast)
        error = _call(fast, dict(step))
        assert error == _call(full, step), f"step {i}"
        if error is None:
            last = np.asarray(step["obs"]).reshape(last.shape).astype(np.uint8)
        else:
            errors += 1
            assert_same(_observed(fast), before, f"step {i} wrote before raising {error}")
        assert_same(_observed(fast), _observed(full), f"step {i}")
    assert 8 <= errors <= 80
    assert sum(taken) >= 30  # the good steps went the short way
    a, b = fast.sample(4), full.sample(4)
    assert_same(a.data, b.data)


@pytest.mark.parametrize("spec", [
    sr.Spec({"obs": sr.Field((2, 4, 4), np.float32, frame_stack=True), "action": sr.Field((), np.int64)}),
    sr.Spec({"obs": sr.Field((3,), np.float16)}),
    sr.Spec({"obs": sr.Field((2, 4), np.uint8, frame_stack=True),
             "goal": sr.Field((2, 4), np.uint8, frame_stack=True), "action": sr.Field((), np.int64)}),
    sr.Spec({"obs": sr.Field((2, 4), np.uint8, frame_stack=True)}),
], ids=["float frame stack", "float16", "two frame stacks", "a frame stack alone"])
def test_specs_without_a_short_path_take_the_full_one(spec: sr.Spec) -> None:
    buf = sr.ReplayBuffer(spec, num_streams=1, stream_capacity=8)
    assert not testing.shard(buf).use_one_step()


def test_a_big_endian_field_is_kept_in_native_order_and_samples_what_was_written() -> None:
    """A ``">f4"``/``">i4"`` field is stored as this machine's ``float32``/``int32`` (torch
    takes native order only: sampling one failed before) and takes the short path."""
    spec = sr.Spec({"obs": sr.Field((2,), np.dtype(">f4")), "action": sr.Field((), np.dtype(">i4"))})
    assert spec["obs"].dtype is np.dtype(np.float32) and spec["action"].dtype is np.dtype(np.int32)
    assert sr.Field((), np.float32).dtype is np.dtype(np.float32)  # the builtin descr, as before
    buf = sr.ReplayBuffer(spec, num_streams=1, stream_capacity=16, window=1, seed=0)
    assert testing.shard(buf).use_one_step()
    for i in range(8):
        buf.add({"obs": np.array([[i, -i]], ">f4"), "action": np.array([i], ">i4"),
                 "step_type": np.array([0 if i == 0 else 1])})
    batch = buf.sample(32)
    obs, action = batch.data["obs"][:, 0].numpy(), batch.data["action"][:, 0].numpy()
    assert obs.dtype == np.float32 and action.dtype == np.int32
    np.testing.assert_array_equal(obs[:, 0], action.astype(np.float32))
    np.testing.assert_array_equal(obs[:, 1], -obs[:, 0])
    assert set(action.tolist()) <= set(range(8)) and len(set(action.tolist())) > 1


# Ten fields: the entry point of that arity (kernels/add_step.py), made when a spec asks.
WIDE = sr.Spec({f"f{i}": sr.Field((2,) if i % 2 else (), np.float32 if i % 3 else np.int16)
                for i in range(10)})


@pytest.mark.parametrize("storage", ["memory", "memmap"])
@pytest.mark.parametrize("spec", [SPECS["float"], WIDE], ids=["float", "ten fields"])
def test_short_path_of_any_arity_and_storage_stores_as_the_full_path(
        spec: sr.Spec, storage: str, tmp_path: Any) -> None:
    """The records reach the kernel as plain uint8 rows (memory-mapped ones too)."""
    kw: dict[str, Any] = {"num_streams": 2, "stream_capacity": 5, "window": 2, "seed": 3, "storage": storage}
    fast = sr.ReplayBuffer(spec, **kw, **({"directory": tmp_path / "a"} if storage == "memmap" else {}))
    full = sr.ReplayBuffer(spec, **kw, **({"directory": tmp_path / "b"} if storage == "memmap" else {}))
    assert testing.shard(fast).use_one_step()
    assert not testing.shard(full).use_one_step(False)
    rng = np.random.default_rng(5)
    short = testing.shard(fast)._one_step
    assert short is not None
    for i in range(12):
        step = _good(spec, 2, rng)
        if i == 6:
            _nan(step, spec)
        assert short.add(dict(step)) == (i != 6)  # taken, but for the NaN (refused, nothing written)
        if i != 6:
            full.add(step)
        assert_same(_observed(fast), _observed(full), f"step {i}")


# One frame-stacked field takes one compiled call (kernels/add_step.py's add_stacked_k). Frames of
# 8 bytes (uint8) and of 18 (int16: bytes past the last whole 8-byte word), a plain
# field of its own array (over 32 bytes a step), rings that must grow (many resets in
# 4-step streams), prioritized sampling (the sampler told of every write).
STACKED = {
    "uint8": sr.Spec({"obs": sr.Field((3, 2, 4), np.uint8, frame_stack=True),
                      "action": sr.Field((), np.int64), "reward": sr.Field((), np.float32)}),
    "int16, own field": sr.Spec({"obs": sr.Field((2, 3, 3), np.int16, frame_stack=True),
                                 "wide": sr.Field((9,), np.float32), "reward": sr.Field((), np.float32)}),
}


def _continued(spec: sr.Spec, last: np.ndarray, streams: int, rng: np.random.Generator) -> dict[str, Any]:
    """A step in the stored dtypes whose stacks continue ``last``, or (half the time) do
    not: refused unless the step is FIRST or follows a LAST."""
    f = spec["obs"]
    new = rng.integers(0, 3, (streams, 1, *f.shape[1:]))
    obs = np.concatenate([last[:, 1:], new], axis=1).astype(f.dtype)
    if rng.random() < 0.5:
        obs = rng.integers(0, 3, obs.shape).astype(f.dtype)
    step = {name: rng.standard_normal((streams, *spec[name].shape)).astype(spec[name].dtype)
            for name in spec.names if name != "obs"}
    step["obs"] = obs
    step["step_type"] = rng.choice([0, 0, 1, 2], streams).astype(np.uint8)
    return step


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
@pytest.mark.parametrize("kind", sorted(STACKED))
def test_one_frame_stacked_field_stores_and_raises_as_the_full_path(kind: str, sampler: str) -> None:
    spec = STACKED[kind]
    kw: dict[str, Any] = {"num_streams": 2, "stream_capacity": 4, "window": 2, "sampler": sampler, "seed": 2}
    fast, full = sr.ReplayBuffer(spec, **kw), sr.ReplayBuffer(spec, **kw)
    assert testing.shard(fast).use_one_step() and not testing.shard(full).use_one_step(False)
    short = testing.shard(fast)._one_step
    assert short is not None
    frames, full_frames = (testing.shard(b)._storage.stacked["obs"] for b in (fast, full))
    rng = np.random.default_rng(len(kind) + len(sampler))
    last = np.zeros((2, *spec["obs"].shape), spec["obs"].dtype)
    taken = errors = 0
    ring = frames.frame_capacity
    for i in range(60):
        step = _continued(spec, last, 2, rng)
        before = _observed(fast)
        took = short.add(dict(step))
        error = None if took else _call(fast, dict(step))
        assert error == _call(full, step), f"step {i}"
        taken += took
        if error is None:
            last = step["obs"]
        else:
            errors += 1
            assert_same(_observed(fast), before, f"step {i} wrote before raising {error}")
        assert_same(_observed(fast), _observed(full), f"step {i}")
        # The same frames appended (one for a continued stack, else K), at the same places.
        np.testing.assert_array_equal(frames.fpos, full_frames.fpos)
        np.testing.assert_array_equal(frames.ref, full_frames.ref)
    assert taken >= 30 and errors >= 3
    assert frames.frame_capacity > ring  # a ring grew on the short path (NEED_FRAMES, then again)
    assert_same(fast.sample(4).data, full.sample(4).data)


DISCOUNTS = {"float32": np.array([0.5, 0.0], np.float32), "float64": np.array([0.25, 1.0]),
             "list": [0.5, 1.0], "bool": np.array([True, False]), "above 1": np.array([1.5, 0.5], np.float32),
             "NaN": np.array([np.nan, 0.5], np.float32)}


@pytest.mark.parametrize("given", sorted(DISCOUNTS))
def test_a_frame_stacked_step_with_a_discount_stores_and_raises_as_the_full_path(given: str) -> None:
    """The stacked kernel takes a step's discount as the plain one does: converted as the
    full path converts it (float64, a list, bools), refused as it refuses it (above 1,
    NaN), nothing written then."""
    spec = STACKED["uint8"]
    kw: dict[str, Any] = {"num_streams": 2, "stream_capacity": 4, "window": 2, "seed": 2}
    fast, full = sr.ReplayBuffer(spec, **kw), sr.ReplayBuffer(spec, **kw)
    assert testing.shard(fast).use_one_step() and not testing.shard(full).use_one_step(False)
    short = testing.shard(fast)._one_step
    assert short is not None
    rng = np.random.default_rng(3)
    obs = np.zeros((2, *spec["obs"].shape), np.uint8)
    for i in range(6):  # a FIRST step, then MID steps whose stacks continue
        new = rng.integers(0, 9, (2, 1, *obs.shape[2:]), dtype=np.uint8)
        obs = np.concatenate([obs[:, 1:], new], axis=1)
        step = {"obs": obs, "action": rng.integers(0, 9, 2), "reward": np.ones(2, np.float32),
                "step_type": np.full(2, 0 if i == 0 else 1, np.uint8), "discount": DISCOUNTS[given]}
        before = _observed(fast)
        took = short.add(dict(step))
        assert took == (given not in ("above 1", "NaN")), f"step {i}"
        error = None if took else _call(fast, dict(step))
        assert error == _call(full, step), f"step {i}"
        if error is not None:
            assert_same(_observed(fast), before, f"step {i} wrote before raising {error}")
        assert_same(_observed(fast), _observed(full), f"step {i}")


def test_the_short_path_keeps_no_frame_ring_that_a_full_write_replaced() -> None:
    """A ring grown by a write of the full path (``extend``) is freed: the one-step path
    reads the ring at each call and keeps none (a kept one would hold its memory)."""
    spec = STACKED["uint8"]
    buf = sr.ReplayBuffer(spec, num_streams=1, stream_capacity=4, window=2, seed=0)
    assert testing.shard(buf).use_one_step()
    rng = np.random.default_rng(0)
    step = _continued(spec, np.zeros((1, *spec["obs"].shape), np.uint8), 1, rng)
    step["step_type"] = np.zeros(1, np.uint8)
    assert testing.shard(buf)._one_step.add(step)  # type: ignore[union-attr]
    store = testing.shard(buf)._storage.stacked["obs"]
    old, ring = weakref.ref(store.frames), store.frame_capacity
    chunk = {"obs": rng.integers(0, 9, (1, 4, *spec["obs"].shape), dtype=np.uint8),  # K frames each
             "action": np.zeros((1, 4), np.int64), "reward": np.zeros((1, 4), np.float32),
             "step_type": np.zeros((1, 4), np.uint8)}
    buf.extend(chunk)
    assert store.frame_capacity > ring
    gc.collect()
    assert old() is None
