"""kernels/cast.py: the one-step add's stores of any numeric input as a field's dtype agree
with ``spec/coerce.as_stored`` (what is refused, and the bytes of what is stored) for every
pair of a value's dtype and a stored dtype, at the edges of each range."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from shardreplay.errors import SpecMismatchError
from shardreplay.kernels.cast import c_code, fits, item, store_as
from shardreplay.kernels.codes import STORED_DTYPES, stored_code
from shardreplay.spec.coerce import as_stored


@numba.njit
def _stored_by_kernel(values, code, finite, out):  # pragma: no cover - compiled
    """Per value: whether it fits ``code``'s dtype, and (if so) its bytes in ``out``'s row."""
    ok = np.zeros(values.size, np.bool_)
    for k in range(values.size):
        ok[k] = fits(values[k], code, finite)
        if ok[k]:
            store_as(out, k * out.shape[1], values[k], code)
    return ok


def _edges(dtype: np.dtype) -> np.ndarray:
    """Values of ``dtype`` at the edges of every stored dtype's range, and some inside."""
    if dtype.kind == "b":
        return np.array([False, True])
    if dtype.kind == "f":
        big = np.finfo(np.float32).max
        return np.array([0.0, -1.5, 2.5, big, -big, np.inf, -np.inf, np.nan, 1e-50,
                         float(big) * 2 if dtype.itemsize == 8 else 1.0], dtype)
    info = np.iinfo(dtype)
    cands = {0, 1, -1, info.min, info.max}
    for d in STORED_DTYPES:
        if d.kind in "iu":
            other = np.iinfo(d)
            cands |= {int(other.min), int(other.max), int(other.max) + 1, int(other.min) - 1}
    return np.array(sorted(c for c in cands if info.min <= c <= info.max), dtype)


def _expected(values: np.ndarray, dtype: np.dtype, finite: bool) -> list[bytes | None]:
    """``as_stored``'s verdict on each value alone: its stored bytes, or None (refused)."""
    out: list[bytes | None] = []
    for v in values:
        try:
            stored = as_stored("x", np.array([v]), dtype, (1,))
        except SpecMismatchError:
            out.append(None)
            continue
        if finite and dtype.kind == "f" and not np.isfinite(stored).all():
            out.append(None)  # the full path's finite check, on the stored value
        else:
            out.append(stored.tobytes())
    return out


@pytest.mark.parametrize("src", STORED_DTYPES, ids=str)
def test_every_pair_of_dtypes_is_stored_as_as_stored_stores_it(src: np.dtype) -> None:
    values = _edges(src)
    for dst in STORED_DTYPES:
        for finite in (False, True):
            out = np.zeros((values.size, dst.itemsize), np.uint8)
            with np.errstate(over="ignore", invalid="ignore"):
                ok = _stored_by_kernel(values, stored_code(dst), finite, out)
                want = _expected(values, dst, finite)
            got = [out[k].tobytes() if ok[k] else None for k in range(values.size)]
            assert got == want, (src, dst, finite, values)


def test_c_code_is_the_stored_code_of_a_c_contiguous_array_only() -> None:
    @numba.njit
    def code_of(a):  # pragma: no cover - compiled
        return c_code(a)
    for dtype in STORED_DTYPES:
        assert code_of(np.zeros((2, 3), dtype)) == stored_code(dtype)
        assert code_of(np.zeros((2, 6), dtype)[:, ::2]) == -1
    assert code_of(np.zeros(3, np.complex64)) == -1


@numba.njit
def _rows_by_item(a):  # pragma: no cover - compiled
    per = a.size // a.shape[0]
    out = np.zeros((a.shape[0], per), np.float64)
    for i in range(a.shape[0]):
        for k in range(per):
            out[i, k] = item(a, i, k)
    return out


@pytest.mark.parametrize("shape", [(5,), (5, 4), (5, 2, 3)])
def test_item_reads_rows_in_c_order_of_any_layout(shape: tuple[int, ...]) -> None:
    base = np.arange(np.prod(shape) * 2, dtype=np.float32).reshape(*shape[:-1], shape[-1] * 2)
    for a in (base[..., ::2], np.ascontiguousarray(base[..., ::2]), base[::-1, ...][..., 1::2]):
        np.testing.assert_array_equal(_rows_by_item(a), a.reshape(shape[0], -1))
