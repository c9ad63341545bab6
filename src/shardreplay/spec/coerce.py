"""Inputs as they are stored: the one conversion of whatever a user passes for a field.

A step's values come as numpy arrays of any dtype and layout, Python scalars and lists,
numpy scalars, or torch tensors (CPU: read without a copy; CUDA: one copy to the host).
:func:`as_stored` turns one of them into a C-contiguous array of the stored dtype, or
raises a one-line :class:`SpecMismatchError`: integers go into any integer field whose
range holds them (checked), floats into float fields, bools and integers into float
fields; a float into an integer field, a value out of range, a wrong shape are refused.

:func:`stored_values` does the same for the arguments of a compiled write (the one-step
add), cheaply enough to sit in front of every call: arguments already in the stored
dtypes pass with one comparison of numba's own type key of the call (so a compiled call
never fails its dispatch on them), numpy arrays of another kind take a conversion planned
once per kind (a cast, a contiguous copy), and anything else :func:`as_stored`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shardreplay.errors import SpecMismatchError

__all__ = ["as_stored", "stored_values", "to_numpy"]

STEP_TYPE_RULE = "field 'step_type': values must be FIRST=0, MID=1 or LAST=2"

# numpy >= 2.3 casts integers with a range check in the same pass (ValueError out of range).
try:
    np.zeros(1, np.int64).astype(np.uint8, casting="same_value")
    _SAME_VALUE = True
except (TypeError, ValueError):  # pragma: no cover - older numpy
    _SAME_VALUE = False

_PLANS_KEPT = 64  # input kinds planned per stored_values (beyond: planned each call)
_MEMO_BYTES, _MEMO_KEPT = 64, 1024  # small integer arrays whose casts are remembered, how many


def to_numpy(value: Any) -> np.ndarray:
    """``value`` as a numpy array: a torch tensor without a copy when it is on the CPU and
    needs no grad (one copy from a device), anything else through ``np.asarray``.

    Raises:
        SpecMismatchError: a tensor of a dtype numpy has no form of (bfloat16).
    """
    if type(value) is np.ndarray:
        return value
    if hasattr(value, "detach"):  # a torch tensor, without importing torch here
        try:
            return value.numpy()
        except (RuntimeError, TypeError):  # it needs grad, or lives on a device
            try:
                return value.detach().cpu().numpy()
            except TypeError as e:
                raise SpecMismatchError(f"cannot read a {value.dtype} tensor as numpy ({e}); "
                                        "convert it (.float()) first") from None
    return np.asarray(value)


def as_stored(name: str, value: Any, dtype: np.dtype, shape: tuple[int, ...],
              field_ndim: int = -1) -> np.ndarray:
    """``value`` as an array of ``dtype`` and ``shape`` (the value itself when it is one
    already; a conversion gives a C-contiguous array).

    Missing unit axes are added (see :func:`_reshaped`): one env's step without its
    leading axis, a Python scalar, a ``(1,)`` Box action as ``[num_envs]`` (as SB3 takes
    it). ``field_ndim``: how many of the last axes of ``shape`` are the field's own (-1:
    unknown: no unit axis of the field's own is added).

    Raises:
        SpecMismatchError: a shape or dtype that cannot be stored, or integers outside the
            stored dtype's range; one line that says what was expected.
    """
    arr = to_numpy(value)
    if arr.shape != shape:
        arr = _reshaped(name, arr, shape, field_ndim)
    if arr.dtype != dtype:
        arr = _cast(name, arr, dtype)
    return arr


def _compiled_form(arr: np.ndarray) -> np.ndarray:
    """``arr`` as the compiled writes take it: C-contiguous and writable."""
    return arr if arr.flags.c_contiguous and arr.flags.writeable else np.array(arr, order="C")


def _reshaped(name: str, arr: np.ndarray, shape: tuple[int, ...], field_ndim: int) -> np.ndarray:
    """``arr`` reshaped to ``shape`` when only unit axes are missing, so the values keep
    their order: leading ones (one env's step, as a single env returns it, or a Python
    scalar) or the field's own last one (a ``(1,)`` Box action given as ``[num_envs]``)."""
    lead_units = len(shape) - len(tuple(_drop_leading_ones(shape)))
    if any(arr.shape == shape[k:] for k in range(1, lead_units + 1)) or (
            field_ndim > 0 and shape[-1] == 1 and arr.shape == shape[:-1]):
        return arr.reshape(shape)
    raise SpecMismatchError(f"field {name!r}: expected shape {shape} (leading axes, then the field's "
                            f"shape), got {arr.shape}")


def _drop_leading_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    k = 0
    while k < len(shape) and shape[k] == 1:
        k += 1
    return shape[k:]


def _cast(name: str, arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    # Integers go into any integer field whose range holds the values (int64 -> uint8 is
    # the common case of Python ints); numpy's same_kind would refuse signed -> unsigned.
    if name == "step_type" and arr.dtype.kind not in "iu":
        raise SpecMismatchError(f"field 'step_type': expected integers 0/1/2 (StepType), got {arr.dtype}")
    if dtype.kind in "iu" and arr.dtype.kind in "iub":
        try:
            return _narrowed(arr, dtype)
        except ValueError:
            raise SpecMismatchError(STEP_TYPE_RULE if name == "step_type" else
                                    f"field {name!r}: values outside the range of {dtype}") from None
    if not np.can_cast(arr.dtype, dtype, casting="same_kind"):
        raise SpecMismatchError(f"field {name!r}: cannot cast {arr.dtype} to {dtype} safely "
                                f"(expected {dtype})")
    return arr.astype(dtype, order="C")


def _narrowed(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Integers (or bools) as ``dtype``, C-contiguous. Raises ValueError when a value
    does not fit."""
    if _SAME_VALUE:
        return arr.astype(dtype, order="C", casting="same_value")
    if arr.size and not np.can_cast(arr.dtype, dtype, casting="safe"):  # pragma: no cover - older numpy
        info = np.iinfo(dtype)
        if arr.min() < info.min or arr.max() > info.max:
            raise ValueError(f"values outside the range of {dtype}")
    return arr.astype(dtype, order="C")  # pragma: no cover - older numpy


# (name, stored dtype, shape with the leading axes, the field's own number of axes)
Target = tuple[str, np.dtype, tuple[int, ...], int]
_Plan = tuple[tuple[int, Callable[[Any], np.ndarray]], ...]  # (index, conversion) of each value


def stored_values(targets: Sequence[Target]) -> Callable[[tuple[Any, ...]], tuple[Any, ...] | None]:
    """The conversion of the arguments of a compiled write to the form it takes: each
    value of ``targets`` (in call order) as a C-contiguous, writable array of the stored
    dtype.

    The function returned takes a tuple of values and returns the same tuple when all
    are in the stored form already (one compare of numba's own type key of the call),
    them converted otherwise (numpy arrays by a conversion planned once per kind of
    input; lists, scalars and tensors read as arrays first), or None when a value cannot
    be stored (the caller's full validation then raises why). Shapes are checked by the
    compiled write only (except where a conversion adds unit axes).
    """
    # numba's dispatcher keys its compiled forms by this fingerprint of the arguments'
    # types (dtype, dimensions, layout, writability): equal keys, same compiled call.
    from numba._dispatcher import compute_fingerprint as fingerprint

    targets = tuple(targets)
    typed = fingerprint(tuple(np.zeros(shape, dtype) for _n, dtype, shape, _d in targets))
    plans: dict[bytes, _Plan] = {}

    def stored(values: tuple[Any, ...]) -> tuple[Any, ...] | None:
        try:
            key = fingerprint(values)
        except (NotImplementedError, ValueError, TypeError):  # a tensor, or another object
            key = b""
        if key == typed:
            return values
        steps = plans.get(key)
        if steps is not None and len(steps) == 1:  # the usual case: one value in another dtype
            i, convert = steps[0]
            try:
                return values[:i] + (convert(values[i]),) + values[i + 1:]  # noqa: RUF005 (fewer steps)
            except (SpecMismatchError, ValueError, TypeError):
                return None  # refused: the full validation says why
        try:
            if steps is None:  # not numpy arrays, or arrays of a kind not seen yet
                values = tuple(map(to_numpy, values))  # tensors and lists as arrays, no cast yet
                key = fingerprint(values)
                if key == typed:
                    return values
                steps = plans.get(key)
                if steps is None:
                    converted, steps = _planned(targets, values)
                    if len(plans) < _PLANS_KEPT:
                        plans[key] = steps
                    return converted
            out = list(values)
            for i, convert in steps:
                out[i] = convert(values[i])
            return tuple(out)
        except (SpecMismatchError, ValueError, TypeError, NotImplementedError):
            return None  # refused (or no numba type: text): the full validation says why
    return stored


def _planned(targets: tuple[Target, ...],
             arrays: tuple[np.ndarray, ...]) -> tuple[tuple[np.ndarray, ...], _Plan]:
    """``arrays`` converted, and what was done to each, for arrays of this kind (their
    dtypes, dimensions and layouts). Raises what :func:`as_stored` raises."""
    steps: list[tuple[int, Callable[[Any], np.ndarray]]] = []
    out = []
    for i, ((name, dtype, shape, ndim), arr) in enumerate(zip(targets, arrays, strict=True)):
        stored = _compiled_form(as_stored(name, arr, dtype, shape, ndim))  # raises if it never fits
        out.append(stored)
        if stored is not arr:
            steps.append((i, _array_plan(name, arr, dtype, shape, ndim)))
    return tuple(out), tuple(steps)


def _generic(name: str, dtype: np.dtype, shape: tuple[int, ...], ndim: int) -> Callable[[Any], np.ndarray]:
    def convert(value: Any) -> np.ndarray:
        return _compiled_form(as_stored(name, value, dtype, shape, ndim))
    return convert


def _array_plan(name: str, arr: np.ndarray, dtype: np.dtype, shape: tuple[int, ...],
                ndim: int) -> Callable[[Any], np.ndarray]:
    """The fewest numpy calls that store arrays of ``arr``'s kind (dtype, dimensions,
    layout, writability), which :func:`as_stored` took once."""
    if arr.ndim != len(shape):  # unit axes added: for arrays of exactly this shape
        then = _array_plan(name, arr.reshape(shape), dtype, shape, ndim)
        return _reshape_then(arr.shape, shape, then)
    if _in_stored_form(arr, dtype):
        return _keep
    if arr.dtype == dtype:  # layout or writability only
        return operator.methodcaller("copy", order="C")
    if dtype.kind in "iu" and arr.dtype.kind in "iub":
        if not _SAME_VALUE:  # pragma: no cover - older numpy
            return _generic(name, dtype, shape, ndim)
        if arr.ndim == 1 and arr.nbytes <= _MEMO_BYTES:
            return _memo_cast(dtype)
        return operator.methodcaller("astype", dtype, order="C", casting="same_value")
    return operator.methodcaller("astype", dtype, order="C")


def _in_stored_form(arr: np.ndarray, dtype: np.dtype) -> bool:
    """``arr`` is of ``dtype``, C-contiguous and writable (as the compiled writes take it)."""
    return arr.dtype == dtype and arr.flags.c_contiguous and arr.flags.writeable


def _keep(arr: np.ndarray) -> np.ndarray:
    return arr


def _reshape_then(source: tuple[int, ...], shape: tuple[int, ...],
                  then: Callable[[Any], np.ndarray]) -> Callable[[Any], np.ndarray]:
    def convert(arr: np.ndarray) -> np.ndarray:
        if arr.shape != source:
            raise ValueError("another shape: the full validation says whether it fits")
        return then(arr.reshape(shape))
    return convert


def _memo_cast(dtype: np.dtype) -> Callable[[Any], np.ndarray]:
    """A range-checked cast of small 1-D integer arrays (step types, a few envs' discrete
    actions) that remembers its results by the input's bytes: such arrays take few
    distinct values, and a lookup costs less than a cast. The arrays it returns are only
    read by the compiled writes."""
    done: dict[bytes, np.ndarray] = {}

    def cast(arr: np.ndarray) -> np.ndarray:
        key = arr.tobytes()
        got = done.get(key)
        if got is None:
            got = arr.astype(dtype, order="C", casting="same_value")  # ValueError: out of range
            if len(done) >= _MEMO_KEPT:
                done.clear()
            done[key] = got
        return got
    return cast
