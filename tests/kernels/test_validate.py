"""The compiled value checks agree with their plain-numpy references and with the numpy
twins a process runs before numba loads (kernels/reference/validate.py: an actor's chunk checks)
(fixed seeds, random and edge inputs: NaN/inf, negatives, out-of-range step types, empty
arrays)."""

from __future__ import annotations

import numpy as np
import pytest

from shardreplay.kernels import validate as k
from shardreplay.kernels.reference import validate as twin

SPECIALS_F32 = np.array([0.0, -0.0, 1.0, np.nextafter(np.float32(1), np.float32(2)), -1e-45, 1e-45, 0.5,
                         np.nan, -np.nan, np.inf, -np.inf, 3.4e38, -3.4e38], np.float32)


def _one_bad(rng: np.random.Generator, clean: np.ndarray, specials: np.ndarray) -> np.ndarray:
    arr = clean.copy()
    if arr.size:
        arr[rng.integers(arr.size)] = specials[rng.integers(specials.size)]
    return arr


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_max_masked_finds_nan_and_inf_as_numpy(dtype: type) -> None:
    rng = np.random.default_rng(0)
    bits = np.dtype(np.uint32 if dtype == np.float32 else np.uint64)
    mask = bits.type(k.F32_EXPONENT if dtype == np.float32 else k.F64_EXPONENT)
    flagged = 0
    for n in (1, 2, 7, 8, 33, 1000):
        for _ in range(20):
            arr = _one_bad(rng, rng.standard_normal(n).astype(dtype), SPECIALS_F32.astype(dtype))
            words = arr.view(bits)
            got = k.max_masked(words, mask)
            assert got == np.bitwise_and(words, mask).max()
            assert (got == mask) == (not np.isfinite(arr).all())
            flagged += got == mask
    assert 0 < flagged < 120  # both outcomes were exercised


@pytest.mark.parametrize("types_dtype", [np.uint8, np.int32, np.int64])
def test_steps_ok_agrees_with_the_reference(types_dtype: type) -> None:
    rng = np.random.default_rng(1)
    type_specials = np.array([0, 1, 2, 3, 255] + ([-1, -128] if np.dtype(types_dtype).kind == "i" else []))
    outcomes = set()
    for n in (0, 1, 5, 64, 513):
        for _ in range(30):
            types = rng.integers(0, 3, n).astype(types_dtype)
            discount = rng.random(n).astype(np.float32)
            if rng.random() < 0.5:
                types = _one_bad(rng, types, type_specials.astype(types_dtype))
            if rng.random() < 0.5:
                discount = _one_bad(rng, discount, np.array([*SPECIALS_F32, -0.5, 2.0], np.float32))
            got = k.steps_ok(types, discount)
            assert got == twin.steps_ok(types, discount), (types, discount)
            outcomes.add(got)
    assert outcomes == {k.STEPS_OK, k.BAD_STEP_TYPE, k.BAD_DISCOUNT}


def test_steps_ok_edges() -> None:
    empty_t, empty_d = np.zeros(0, np.uint8), np.zeros(0, np.float32)
    assert k.steps_ok(empty_t, empty_d) == twin.steps_ok(empty_t, empty_d) == k.STEPS_OK
    for value, want in ((0.0, k.STEPS_OK), (-0.0, k.STEPS_OK), (1.0, k.STEPS_OK), (np.nan, k.BAD_DISCOUNT),
                        (np.inf, k.BAD_DISCOUNT), (-1e-45, k.BAD_DISCOUNT), (1.0000001, k.BAD_DISCOUNT)):
        d = np.array([value], np.float32)
        assert k.steps_ok(empty_t, d) == twin.steps_ok(empty_t, d) == want, value
    for value, want in ((0, k.STEPS_OK), (2, k.STEPS_OK), (3, k.BAD_STEP_TYPE), (-1, k.BAD_STEP_TYPE)):
        t = np.array([value], np.int64)
        assert k.steps_ok(t, empty_d) == twin.steps_ok(t, empty_d) == want, value


def _packed(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A payload of f32, f64, step type and discount blocks (8-byte aligned) and its plan."""
    blocks = [(k.FINITE_F32, rng.standard_normal(3 * n).astype(np.float32)),
              (k.FINITE_F64, rng.standard_normal(n)),
              (k.STEP_TYPES, rng.integers(0, 3, n).astype(np.uint8)),
              (k.DISCOUNTS, rng.random(n).astype(np.float32)),
              (-1, np.full(n, np.nan, np.float32))]  # not checked: no plan row
    payload, plan = bytearray(), []
    for kind, values in blocks:
        if kind >= 0:
            plan.append((kind, len(payload), values.size))
        payload += values.tobytes()
        payload += bytes(-len(payload) % 8)
    return np.frombuffer(bytes(payload), np.uint8).copy(), np.array(plan, np.int64).reshape(-1, 3)


def test_values_ok_agrees_with_the_reference() -> None:
    rng = np.random.default_rng(2)
    outcomes = set()
    specials = {k.FINITE_F32: SPECIALS_F32, k.FINITE_F64: SPECIALS_F32.astype(np.float64),
                k.STEP_TYPES: np.array([0, 2, 3, 255], np.uint8),
                k.DISCOUNTS: np.array([*SPECIALS_F32, -0.5, 2.0], np.float32)}
    dtypes = {k.FINITE_F32: np.float32, k.FINITE_F64: np.float64, k.STEP_TYPES: np.uint8,
              k.DISCOUNTS: np.float32}
    for n in (0, 1, 3, 8, 100):
        for _ in range(40):
            payload, plan = _packed(rng, n)
            if n and rng.random() < 0.7:
                row = int(rng.integers(plan.shape[0]))
                kind, off, count = plan[row]
                dtype = np.dtype(dtypes[int(kind)])
                block = payload[off:off + count * dtype.itemsize].view(dtype)
                block[rng.integers(count)] = rng.choice(specials[int(kind)])
            got = k.values_ok(payload, plan)
            assert got == twin.values_ok(payload, plan)
            outcomes.add(got)
    assert -1 in outcomes and len(outcomes) >= 4  # clean payloads and failures in every kind


def test_values_ok_on_an_empty_plan_and_payload() -> None:
    empty = np.zeros(0, np.uint8)
    plan = np.zeros((0, 3), np.int64)
    assert k.values_ok(empty, plan) == twin.values_ok(empty, plan) == -1
    assert twin.values_ok(empty, plan) == -1
