"""Inputs as they are stored: the one conversion of whatever a user passes for a field.

A step's values come as numpy arrays of any dtype and layout, Python scalars and lists,
numpy scalars, or torch tensors (CPU: read without a copy; CUDA: one copy to the host).
:func:`as_stored` turns one of them into a C-contiguous array of the stored dtype, or
raises a one-line :class:`SpecMismatchError`: integers go into any integer field whose
range holds them (checked), floats into float fields, bools and integers into float
fields; a float into an integer field, a value out of range, a wrong shape are refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardreplay.errors import SpecMismatchError

__all__ = ["as_stored", "is_number", "to_numpy", "with_unit_axes"]

STEP_TYPE_RULE = "field 'step_type': values must be FIRST=0, MID=1 or LAST=2"

# numpy >= 2.3 casts integers with a range check in the same pass (ValueError out of range).
try:
    np.zeros(1, np.int64).astype(np.uint8, casting="same_value")
    _SAME_VALUE = True
except (TypeError, ValueError):  # pragma: no cover - older numpy
    _SAME_VALUE = False


def to_numpy(value: Any) -> np.ndarray:
    """``value`` as a numpy array: a torch tensor without a copy when it is on the CPU and
    needs no grad (one copy from a device), anything else through ``np.asarray``.

    Raises:
        SpecMismatchError: a tensor of a dtype numpy has no form of (bfloat16).
    """
    if type(value) in (np.ndarray, list):  # a list: not by hasattr, whose miss raises inside
        return np.asarray(value)
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

    Missing unit axes are added (see :func:`with_unit_axes`): one env's step without its
    leading axis, a Python scalar, a ``(1,)`` Box action as ``[num_envs]`` (as SB3 takes
    it). ``field_ndim``: how many of the last axes of ``shape`` are the field's own (-1:
    unknown: no unit axis of the field's own is added).

    Raises:
        SpecMismatchError: a shape or dtype that cannot be stored, or integers outside the
            stored dtype's range; one line that says what was expected.
    """
    if type(value) is np.ndarray:
        arr = value
    elif is_number(value, dtype):  # a Python number (one env's scalar): read as stored in one call
        try:
            arr = np.array(value, dtype, ndmin=len(shape))
        except OverflowError:  # an integer out of range: refused below, in one line
            arr = np.asarray(value)
    else:
        arr = to_numpy(value)
    if arr.shape != shape:
        arr = with_unit_axes(name, arr, shape, field_ndim)
    if arr.dtype is dtype or arr.dtype == dtype:  # ``is``: numpy's one object per builtin dtype
        return arr
    kind = arr.dtype.kind
    if dtype.kind == "f" and kind in "biuf":  # numpy's same_kind, without asking it
        return arr.astype(dtype, order="C")
    return _cast(name, arr, dtype)


def is_number(value: Any, dtype: np.dtype) -> bool:
    """Whether ``value`` is a Python number that numpy reads as ``dtype`` by itself: any
    into a float field, an int or bool into an integer one (OverflowError out of range)."""
    return isinstance(value, (int, float)) and dtype.kind in "fiu" and (
        dtype.kind == "f" or not isinstance(value, float))


def with_unit_axes(name: str, arr: np.ndarray, shape: tuple[int, ...], field_ndim: int) -> np.ndarray:
    """``arr`` reshaped to ``shape`` when only unit axes are missing, so the values keep
    their order: leading ones (one env's step, as a single env returns it, or a Python
    scalar) or the field's own last one (a ``(1,)`` Box action given as ``[num_envs]``).

    Raises:
        SpecMismatchError: any other shape.
    """
    k = len(shape) - arr.ndim  # the axes missing
    if (k > 0 and shape[k:] == arr.shape and shape[:k] == (1,) * k) or (
            k == 1 and field_ndim > 0 and shape[-1] == 1 and arr.shape == shape[:-1]):
        return arr.reshape(shape)
    raise SpecMismatchError(f"field {name!r}: expected shape {shape} (leading axes, then the field's "
                            f"shape), got {arr.shape}")


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
