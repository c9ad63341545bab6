"""state_dict / load_state_dict: exact continuation, and refusal of foreign states."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from core_fixtures import assert_same, snapshot
from core_programs import Program, apply_write, make_buffer, random_program

from shardreplay import ConfigError, EmptyBufferError, Field, LinearSchedule, ReplayBuffer, Spec
from shardreplay.errors import SpecMismatchError

SAMPLERS = [("uniform", 0.6), ("prioritized", 0.7), ("prioritized", 0.0), ("fifo", 0.6)]


def _program(seed: int) -> Program:
    return random_program(np.random.default_rng(seed), num_streams=3, capacity=6, window=3,
                          n_writes=30, with_priorities=True)


def _run(buf: ReplayBuffer, prog: Program, rng: np.random.Generator) -> None:
    """Writes with samples and priority updates in between (updates include zeros)."""
    for op in prog.writes:
        apply_write(buf, None, op)
        if len(buf) and rng.random() < 0.5:
            try:
                batch = buf.sample(int(rng.integers(1, 6)))
            except EmptyBufferError:  # prioritized with every priority 0
                continue
            buf.update_priorities(batch.keys, rng.choice([0.0, 0.3, 2.0], size=len(batch)))


def _assert_same_batches(a: ReplayBuffer, b: ReplayBuffer, size: int) -> None:
    try:
        ba = a.sample(size)
    except EmptyBufferError:
        with pytest.raises(EmptyBufferError):
            b.sample(size)
        return
    bb = b.sample(size)
    for name in ("keys", "mask", "weights", "probabilities"):
        assert getattr(ba, name).dtype == getattr(bb, name).dtype
        assert getattr(ba, name).tolist() == getattr(bb, name).tolist(), name
    assert ba.data.keys() == bb.data.keys()
    for name in ba.data:
        assert ba.data[name].tolist() == bb.data[name].tolist(), name


@pytest.mark.parametrize(("sampler", "alpha"), SAMPLERS)
def test_round_trip_continues_exactly(sampler: str, alpha: float) -> None:
    prog = _program(seed=3)
    kwargs = {"sampler": sampler, "alpha": alpha, "beta": LinearSchedule(0.3, 1.0, steps=20)}
    a = make_buffer(prog, seed=1, **kwargs)
    _run(a, prog, np.random.default_rng(0))
    b = make_buffer(prog, seed=12345, **kwargs)  # another seed: the state must carry the RNG
    b.load_state_dict(a.state_dict())
    assert len(a) == len(b) and a.num_steps == b.num_steps and a.stale_updates == b.stale_updates
    assert_same(snapshot(a), snapshot(b))
    # Continue both the same way: samples, updates and writes stay identical.
    rng = np.random.default_rng(9)
    more = _program(seed=4).writes[:12]
    for op in more:
        _assert_same_batches(a, b, int(rng.integers(1, 8)))
        if len(a):
            try:
                keys = a.sample(3).keys
                assert keys.tolist() == b.sample(3).keys.tolist()
                prios = rng.choice([0.0, 0.5, 3.0], size=len(keys))  # fifo may give fewer
                assert a.update_priorities(keys, prios) == b.update_priorities(keys, prios)
            except EmptyBufferError:
                with pytest.raises(EmptyBufferError):
                    b.sample(3)
        apply_write(a, None, op)
        apply_write(b, None, op)
    assert_same(snapshot(a), snapshot(b))


def test_state_dict_is_a_copy() -> None:
    prog = _program(seed=5)
    a = make_buffer(prog, sampler="prioritized", seed=0)
    _run(a, prog, np.random.default_rng(1))
    state = a.state_dict()
    kept = copy.deepcopy(state)
    _run(a, _program(seed=6), np.random.default_rng(2))
    assert_same(state, kept)


def _loaded_source() -> tuple[ReplayBuffer, dict]:
    prog = _program(seed=7)
    a = make_buffer(prog, sampler="prioritized", seed=0)
    _run(a, prog, np.random.default_rng(3))
    return a, a.state_dict()


@pytest.mark.parametrize("change", [{"num_streams": 4}, {"stream_capacity": 7}, {"window": 2},
                                    {"sampler": "uniform"}],
                         ids=["streams", "capacity", "window", "sampler"])
def test_load_into_another_layout_raises_and_changes_nothing(change: dict) -> None:
    _, state = _loaded_source()
    from core_ref import SPEC

    args = {"num_streams": 3, "stream_capacity": 6, "window": 3, "sampler": "prioritized", **change}
    target = ReplayBuffer(SPEC, seed=4, **args)
    _run(target, random_program(np.random.default_rng(8), args["num_streams"],
                                args["stream_capacity"], args["window"], 10), np.random.default_rng(4))
    before = snapshot(target)
    with pytest.raises(ConfigError):
        target.load_state_dict(state)
    assert_same(before, snapshot(target))


def test_load_with_another_spec_raises_spec_mismatch_and_changes_nothing() -> None:
    _, state = _loaded_source()
    other = Spec({"obs": Field((2,), np.float32), "act": Field((), np.int32)})
    target = ReplayBuffer(other, num_streams=3, stream_capacity=6, window=3, sampler="prioritized")
    target.add({"obs": np.zeros((3, 2)), "act": np.zeros(3, np.int32), "step_type": np.zeros(3, int)})
    before = snapshot(target)
    with pytest.raises(SpecMismatchError):
        target.load_state_dict(state)
    assert_same(before, snapshot(target))


@pytest.mark.parametrize("damage", ["row_length", "row_pos", "field", "version", "no-meta"])
def test_load_of_a_damaged_state_raises_and_changes_nothing(damage: str) -> None:
    _, state = _loaded_source()
    state = copy.deepcopy(state)
    arrays, meta = state["arrays"], state["meta"]
    if damage == "row_length":
        arrays["row_length"] = arrays["row_length"] + 1
    elif damage == "row_pos":
        arrays["row_pos"] = -arrays["row_pos"]
    elif damage == "field":
        arrays["field.obs"] = arrays["field.obs"][:-1]
    elif damage == "version":
        meta["version"] = 99
    else:
        del state["meta"]
    target = make_buffer(_program(seed=7), sampler="prioritized", seed=0)
    _run(target, _program(seed=8), np.random.default_rng(5))
    before = snapshot(target)
    with pytest.raises(ConfigError):
        target.load_state_dict(state)
    assert_same(before, snapshot(target))


def _damaged(sampler: str, damage: str) -> dict:
    prog = _program(seed=7)
    a = make_buffer(prog, sampler=sampler, seed=0)
    _run(a, prog, np.random.default_rng(3))
    state = copy.deepcopy(a.state_dict())
    meta, arrays = state["meta"], state["arrays"]
    if damage == "next-episode-id-missing":
        del meta["next_episode_id"]
    elif damage == "next-episode-id-text":
        meta["next_episode_id"] = "many"
    elif damage == "rng-state":
        meta["rng"] = {"bit_generator": "MT19937", "state": {}}
    elif damage == "stale-text":
        meta["stale_updates"] = "x"
    elif damage == "fifo-slot-out-of-range":
        arrays["sampler.waiting_slots"] = np.array([10**6])
    elif damage == "fifo-slot-not-a-valid-start":
        invalid = np.flatnonzero(~a._storage.valid)
        arrays["sampler.waiting_slots"] = invalid[:3]
    elif damage == "max-priority-text":
        meta["sampler_state"]["max_priority"] = "high"
    return state


def _assert_refused_unchanged(sampler: str, state: dict) -> None:
    target = make_buffer(_program(seed=7), sampler=sampler, seed=0)
    _run(target, _program(seed=8), np.random.default_rng(5))
    before = snapshot(target)
    with pytest.raises(ConfigError):
        target.load_state_dict(state)
    assert_same(before, snapshot(target))


@pytest.mark.parametrize("damage", ["next-episode-id-missing", "next-episode-id-text", "rng-state",
                                    "stale-text"])
def test_load_of_damaged_meta_raises_and_changes_nothing(damage: str) -> None:
    _assert_refused_unchanged("prioritized", _damaged("prioritized", damage))


@pytest.mark.xfail(strict=True, reason=(
    "sampler state (fifo waiting_slots, prioritized max_priority) is not validated before the "
    "storage is replaced: a damaged one raises IndexError/ValueError half-way, or is accepted "
    "and fifo then serves windows that are not valid starts; needs a check_state per sampler"))
@pytest.mark.parametrize(("sampler", "damage"), [
    ("fifo", "fifo-slot-out-of-range"), ("fifo", "fifo-slot-not-a-valid-start"),
    ("prioritized", "max-priority-text")])
def test_load_of_damaged_sampler_state_raises_and_changes_nothing(sampler: str, damage: str) -> None:
    _assert_refused_unchanged(sampler, _damaged(sampler, damage))
