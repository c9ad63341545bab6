"""Valid window starts, window data and masks against the brute-force reference.

Random programs of add/extend over random stream subsets, with abandoned episodes,
MID after LAST, streams starting with MID, truncations, terminations and ring
overwrites; after every write the buffer's valid starts, ``len`` and sampled windows
must equal the reference's (docs/semantics.md, sampling rules 1 and 2).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from shardreplay import EmptyBufferError, ReplayBuffer, testing
from tests.support.programs import Program, apply_write, make_buffer, programs
from tests.support.reference import FIRST, LAST, MID, SPEC, RefBuffer, check_batch

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check_state(buf: ReplayBuffer, ref: RefBuffer) -> None:
    assert buf.num_steps == ref.num_steps
    assert len(buf) == len(ref.valid_starts())
    assert set(np.flatnonzero(testing.valid(buf)).tolist()) == ref.valid_slots()


@pytest.mark.slow  # fresh interpreters or many examples: 20-100 s at load ~9 on 2 cores
@SETTINGS
@given(prog=programs())
def test_valid_starts_and_windows_match_reference(prog: Program) -> None:
    buf = make_buffer(prog, sampler="uniform", seed=1)
    ref = RefBuffer(prog.num_streams, prog.capacity, prog.window, tag=buf.info().key_tag)
    episodes: dict[int, int] = {}
    for op in prog.writes:
        apply_write(buf, ref, op)
        _check_state(buf, ref)
        if len(buf) == 0:
            with pytest.raises(EmptyBufferError):
                buf.sample(4)
            continue
        batch = buf.sample(12)
        check_batch(ref, batch, episodes)
        np.testing.assert_allclose(batch.probabilities.numpy(), 1.0 / len(buf))
        assert (batch.weights.numpy() == 1.0).all()


@pytest.mark.slow  # fresh interpreters or many examples: 20-100 s at load ~9 on 2 cores
@SETTINGS
@given(prog=programs(with_priorities=True))
def test_prioritized_probabilities_and_weights_match_reference(prog: Program) -> None:
    alpha, beta = 0.7, 0.5
    buf = make_buffer(prog, sampler="prioritized", alpha=alpha, beta=beta, seed=2)
    ref = RefBuffer(prog.num_streams, prog.capacity, prog.window, tag=buf.info().key_tag)
    episodes: dict[int, int] = {}
    rng = np.random.default_rng(0)
    pending: list[tuple[int, int, int]] = []  # (key, row, position) of earlier draws
    for op in prog.writes:
        apply_write(buf, ref, op)
        _check_state(buf, ref)
        probs = ref.probabilities(alpha)
        if not any(p > 0 for p in probs.values()):
            with pytest.raises(EmptyBufferError):
                buf.sample(4)
        else:
            batch = buf.sample(12)
            drawn = check_batch(ref, batch, episodes)
            weights = ref.weights(alpha, beta)
            np.testing.assert_allclose(batch.probabilities.numpy(), [probs[i] for i in drawn],
                                       rtol=1e-9)
            np.testing.assert_allclose(batch.weights.numpy(), [weights[i] for i in drawn], rtol=1e-5)
            pending += [(k, r, q) for k, (r, q) in zip(batch.keys.tolist(), drawn, strict=True)]
        _update_some(buf, ref, pending, rng)
        pending = pending[-40:]


def _update_some(buf: ReplayBuffer, ref: RefBuffer, pending: list[tuple[int, int, int]],
                 rng: np.random.Generator) -> None:
    """Update a random mix of fresh and old keys; the overwritten ones must be ignored."""
    if not pending:
        return
    chosen = [pending[i] for i in rng.choice(len(pending), size=min(len(pending), 10))]
    new = rng.choice([0.0, 0.5, 1.5, 4.0], size=len(chosen))
    current = [q in ref.stored(r) for _, r, q in chosen]
    stale_before = buf.info().stale_updates
    assert buf.update_priorities([k for k, _, _ in chosen], new) == sum(current)
    assert buf.info().stale_updates - stale_before == len(chosen) - sum(current)
    for (_, r, q), p, cur in zip(chosen, new, current, strict=True):
        if cur:  # in call order, so a repeated key keeps its last priority
            ref.update(r, q, p)


def _steps(types: list[int], discounts: list[float] | None = None) -> dict[str, np.ndarray]:
    n = len(types)
    return {"obs": np.arange(2 * n, dtype=np.float32).reshape(1, n, 2),
            "act": np.arange(n, dtype=np.int64)[None], "step_type": np.array([types]),
            "discount": np.array([discounts or [1.0] * n], np.float32)}


@pytest.mark.parametrize(("types", "window", "valid_positions"), [
    pytest.param([MID, MID, MID], 3, [0], id="stream-starts-with-mid"),
    pytest.param([FIRST, MID, FIRST, MID, MID], 3, [2], id="abandoned-episode"),
    pytest.param([FIRST, LAST, MID, MID], 2, [0, 2], id="mid-after-last-starts-episode"),
    pytest.param([FIRST, MID, LAST, FIRST], 4, [0, 1], id="last-closes-short-windows"),
    pytest.param([FIRST, LAST, LAST, LAST], 2, [0], id="lone-lasts-are-one-step-episodes"),
    pytest.param([FIRST, LAST, LAST], 1, [0, 1, 2], id="window-1-every-step"),
    pytest.param([FIRST, MID, MID, MID], 4, [0], id="exactly-full"),
    pytest.param([FIRST, MID, MID], 4, [], id="incomplete"),
])
def test_hand_written_timelines(types: list[int], window: int, valid_positions: list[int]) -> None:
    buf = ReplayBuffer(SPEC, num_streams=1, stream_capacity=8, window=window)
    buf.extend(_steps(types))
    assert np.flatnonzero(testing.valid(buf)).tolist() == valid_positions
    assert len(buf) == len(valid_positions)


def test_ring_overwrite_invalidates_the_overwritten_start_only() -> None:
    #  positions 0..5, capacity 4, window 2: after writing 0..5 the ring holds 2..5.
    buf = ReplayBuffer(SPEC, num_streams=1, stream_capacity=4, window=2)
    buf.extend(_steps([FIRST, MID, MID, MID]))
    assert len(buf) == 3  # starts 0, 1, 2
    buf.extend(_steps([MID, MID]))  # positions 4, 5 overwrite slots 0, 1
    # stored 2..5: starts 2, 3, 4 valid (5 waits for position 6)
    assert sorted(np.flatnonzero(testing.valid(buf)).tolist()) == [0, 2, 3]
    assert len(buf) == 3


def test_truncation_and_termination_keep_their_discount_in_windows() -> None:
    buf = ReplayBuffer(SPEC, num_streams=1, stream_capacity=8, window=3, seed=0)
    buf.extend(_steps([FIRST, LAST, FIRST, LAST], [1.0, 1.0, 1.0, 0.0]))  # truncated, terminated
    batch = buf.sample(64)
    seen = {}
    for b in range(64):
        seen[int(batch.data["act"][b, 0])] = (batch.data["discount"][b].tolist(), batch.mask[b].tolist())
    assert seen == {0: ([1.0, 1.0, 1.0], [True, True, False]),
                    2: ([1.0, 0.0, 0.0], [True, True, False])}
