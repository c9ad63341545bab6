"""The one validation route for steps entering shardreplay (dict writes, packed chunks,
state dicts and checkpoint parts), by the value rule of :mod:`shardreplay.kernels.validate`;
steps checked once may be sealed as :class:`ValidatedSteps`, not checked again."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from shardreplay.errors import ConfigError, SpecMismatchError
from shardreplay.kernels import codes
from shardreplay.kernels.lazy import lazy
from shardreplay.kernels.reference import validate as twins
from shardreplay.spec.coerce import STEP_TYPE_RULE, as_stored, to_numpy
from shardreplay.spec.fields import Field
from shardreplay.spec.layout import DISCOUNT_DTYPE, STEP_TYPE_DTYPE, RecordLayout

if TYPE_CHECKING:
    from shardreplay.kernels import validate as kernels
else:  # numba loads on the first compiled call, not on import (kernels/lazy.py)
    kernels = lazy("shardreplay.kernels.validate")

__all__ = ["PackedSteps", "ValidatedSteps", "check_step_values", "flatten", "packed_steps", "validate",
           "validated", "validated_packed"]


class SpecParts(Protocol):
    """The members of a :class:`~shardreplay.spec.spec.Spec` that validation reads, typed
    by them so that the Spec's module (whose methods call this one) is not imported back."""

    @property
    def _fields(self) -> Mapping[str, Field]:
        """The user fields by dotted name."""

    @property
    def _plan(self) -> tuple[tuple[str, np.dtype, tuple[int, ...], bool], ...]:
        """``(name, dtype, shape, checks_finite)`` of every field, in order."""


DISCOUNT_RULE = ("field 'discount': values must be finite and in [0, 1] "
                 "(0 at a termination, 1 at a truncation and elsewhere)")

_SEAL = object()
_COMPILED_INTS = (np.dtype(np.uint8), np.dtype(np.int32), np.dtype(np.int64))
_EXPONENT_MASKS: dict[np.dtype, tuple[np.dtype, np.unsignedinteger]] = {
    np.dtype(np.float32): (np.dtype(np.uint32), np.uint32(codes.F32_EXPONENT)),
    np.dtype(np.float64): (np.dtype(np.uint64), np.uint64(codes.F64_EXPONENT))}
_FINITE_KINDS = {np.dtype(np.float32): codes.FINITE_F32, np.dtype(np.float64): codes.FINITE_F64}
_ONES: dict[tuple[int, ...], np.ndarray] = {}


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``{"a.b": leaf}`` (the dotted field names); leaves are anything else.

    Raises:
        ConfigError: a key that is not a non-empty string.
    """
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"field names must be non-empty strings, got {key!r}")
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


# -- dict steps ---------------------------------------------------------------------------

def validate(spec: SpecParts, step: Mapping[str, Any], lead_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """:meth:`Spec.validate`, which says what it returns and raises."""
    if type(step) is ValidatedSteps and step.accepted_by(spec, lead_shape):
        return dict(step._arrays)
    fields = spec._fields
    try:
        values = [step[name] for name in fields]
        types = step["step_type"]
    except KeyError:
        values, types = None, None
    if values is None or len(step) != len(fields) + 1 + ("discount" in step):
        flat = _check_names(spec, step)
        values, types = [flat[name] for name in fields], flat["step_type"]
        step = flat
    out = {}
    for (name, dtype, shape, finite), value in zip(spec._plan, values, strict=True):
        out[name] = _checked(name, value, dtype, lead_shape + shape, finite, len(shape))
    types = as_stored("step_type", types, STEP_TYPE_DTYPE, lead_shape)  # integers, range-checked
    discount = _discount_array(step.get("discount"), lead_shape)
    _check_rule(types, discount, SpecMismatchError, "")
    out["step_type"] = types
    out["discount"] = discount
    return out


def validated(spec: SpecParts, step: Mapping[str, Any], lead_shape: tuple[int, ...]) -> ValidatedSteps:
    """:meth:`Spec.validated`, which says what it returns and raises."""
    arrays = validate(spec, step, lead_shape)
    return ValidatedSteps(spec, lead_shape, {k: _read_only(v) for k, v in arrays.items()}, _SEAL)


def _check_names(spec: SpecParts, step: Mapping[str, Any]) -> Mapping[str, Any]:
    """Flatten a nested step and check its names; raise on missing or unknown ones."""
    fields = spec._fields
    flat = flatten(step) if any(isinstance(v, Mapping) for v in step.values()) else step
    missing = [n for n in (*fields, "step_type") if n not in flat]
    if missing:
        raise SpecMismatchError(f"missing field(s) {missing}; a step needs {list(fields)} "
                                "plus 'step_type' (and optionally 'discount')")
    unknown = [n for n in flat if n not in fields and n not in ("step_type", "discount")]
    if unknown:
        raise SpecMismatchError(f"unknown field(s) {unknown}; the spec has {list(fields)}")
    return flat


def _checked(name: str, value: Any, dtype: np.dtype, shape: tuple[int, ...], finite: bool,
             field_ndim: int) -> np.ndarray:
    arr = as_stored(name, value, dtype, shape, field_ndim)
    if finite and arr.size and not _is_finite(arr):
        raise SpecMismatchError(f"field {name!r} contains NaN or inf; it was declared finite "
                                "(Field(finite=False) allows them)")
    return arr


def _is_finite(arr: np.ndarray) -> bool:
    """No NaN or inf (compiled for float32/64: one pass over the bits, no temporary)."""
    exponent = _EXPONENT_MASKS.get(arr.dtype)
    if exponent is not None and "numba" in sys.modules:  # else: numpy, no numba to load
        bits_dtype, mask = exponent
        return bool(kernels.max_masked(arr.reshape(-1).view(bits_dtype), mask) != mask)
    return bool(np.isfinite(arr).all())


def _checks() -> Any:
    """The compiled checks once numba is loaded, their numpy twins until then: a process that
    only checks (an actor checking the chunks it sends) never loads numba."""
    return kernels if "numba" in sys.modules else twins


def _discount_array(value: Any, lead_shape: tuple[int, ...]) -> np.ndarray:
    """Discounts as float32 of ``lead_shape``, 1 where not given (values checked by the caller)."""
    if value is None:
        ones = _ONES.get(lead_shape)
        if ones is None:
            ones = _ONES[lead_shape] = np.ones(lead_shape, DISCOUNT_DTYPE)
            ones.flags.writeable = False
        return ones
    arr = to_numpy(value)
    if arr.dtype.kind not in "biuf":
        raise SpecMismatchError(f"field 'discount': expected numbers in [0, 1], got {arr.dtype}")
    return as_stored("discount", arr, DISCOUNT_DTYPE, lead_shape)


# -- the step rule, for every entry point -------------------------------------------------

def _check_rule(types: np.ndarray, discount: np.ndarray, exc: type[Exception], where: str) -> None:
    """Raise ``exc`` (message prefixed with ``where``) unless integer ``types`` and
    float32 ``discount`` follow the step rule."""
    if types.dtype not in _COMPILED_INTS:  # one compiled form per dtype: widen the rare ones
        types = types.astype(np.int64)  # uint64 beyond int64 wraps negative: refused as well
    found = _checks().steps_ok(types.reshape(-1), discount.reshape(-1))
    if found == codes.BAD_STEP_TYPE:
        raise exc(where + STEP_TYPE_RULE)
    if found == codes.BAD_DISCOUNT:
        raise exc(where + DISCOUNT_RULE)


def check_step_values(step_type: np.ndarray, discount: np.ndarray, *, exc: type[Exception],
                      where: str) -> None:
    """Check stored step types and discounts (a state dict's, a checkpoint part's, any
    shape; discounts cast to float32) against the step rule, raising ``exc`` with a
    message that starts with ``where`` (e.g. ``"state arrays: "``).

    Raises:
        exc: step types that are not integers or not in {0, 1, 2}, or discounts that
            are not numbers or not in [0, 1].
    """
    types, discount = np.asarray(step_type), np.asarray(discount)
    if types.dtype.kind not in "iu":
        raise exc(f"{where}field 'step_type': expected integers 0/1/2 (StepType), got {types.dtype}")
    if discount.dtype.kind not in "biuf":
        raise exc(f"{where}field 'discount': expected numbers in [0, 1], got {discount.dtype}")
    _check_rule(types, discount.astype(DISCOUNT_DTYPE, copy=False), exc, where)


# -- steps packed in bytes ----------------------------------------------------------------

class PackedSteps:
    """Where the steps of one spec and leading shape sit in a byte payload, and the
    compiled value checks (a plan for :func:`kernels.values_ok`) that validate them.

    Built by :func:`packed_steps`. Attributes:
        lead_shape: ``(S,)`` or ``(S, T)``.
        layout: the payload's record layout; ``prefix`` starts the step parts' names.
        plan: int64 ``[k, 3]`` rows ``(kind, byte offset, count)``.
        nbytes: bytes the payload needs (up to the end of the last step part).
    """

    __slots__ = ("_views", "layout", "lead_shape", "nbytes", "plan", "prefix")

    def __init__(self, lead_shape: tuple[int, ...], layout: RecordLayout, prefix: str,
                 plan: list[tuple[int, int, int]]) -> None:
        self.lead_shape, self.layout, self.prefix = tuple(lead_shape), layout, prefix
        self.plan = np.array(plan, np.int64).reshape(-1, 3)
        steps = [p for p in layout.parts if p.name.startswith(prefix)]
        self.nbytes = max((p.end for p in steps), default=0)
        # (name, shape, dtype, offset) of each step array: decode makes these views per chunk.
        self._views = tuple((p.name[len(prefix):], p.shape, p.dtype, p.offset) for p in steps)

    def arrays(self, payload: np.ndarray) -> dict[str, np.ndarray]:
        """Views of every step array in ``payload`` (no copy; as writable as ``payload``)."""
        data = payload.data
        return {name: np.ndarray(shape, dtype, data, offset) for name, shape, dtype, offset in self._views}

    def check(self, spec: SpecParts, payload: np.ndarray, steps: Mapping[str, Any]) -> None:
        """Check every value of the steps in uint8 ``payload`` (its length a multiple of
        8) in one compiled pass; ``steps`` are the same steps as arrays, checked again
        with :func:`validate` only on a failure, to name the field.

        Raises:
            SpecMismatchError: a value the spec forbids, named by its field.
        """
        if _checks().values_ok(payload, self.plan) >= 0:
            validate(spec, steps, self.lead_shape)  # raises, naming the field
            raise SpecMismatchError("steps hold a value the spec forbids")  # pragma: no cover


def packed_steps(spec: SpecParts, layout: RecordLayout, prefix: str,
                 lead_shape: tuple[int, ...]) -> PackedSteps | None:
    """The compiled checks of the steps that ``layout`` holds as parts named ``prefix +
    field`` (every user field, ``step_type`` and ``discount``, with this spec's shapes).

    Returns:
        None when a field has no compiled check (a finite float16 field, say):
        validate views with :func:`validated` then.

    Raises:
        ConfigError: a step field is missing from ``layout`` or has the wrong shape, or
            an offset is not a multiple of 8 (a bug in the caller's layout).
    """
    parts = {p.name[len(prefix):]: p for p in layout.parts if p.name.startswith(prefix)}
    wanted: list[tuple[str, tuple[int, ...], bool, str | None]] = [
        (n, f.shape, f.checks_finite, None) for n, f in spec._fields.items()]
    wanted += [("step_type", (), False, "step_type"), ("discount", (), False, "discount")]
    plan = []
    for name, shape, finite, reserved in wanted:
        part = parts.get(name)
        if part is None or part.shape != (*lead_shape, *shape) or part.offset % 8:
            raise ConfigError(f"layout part {prefix + name!r} is missing, misshapen or unaligned")
        kind = _check_kind(part.dtype, finite, reserved)
        if kind is None:
            return None
        if kind >= 0:
            plan.append((kind, part.offset, part.count))
    return PackedSteps(lead_shape, layout, prefix, plan)


def _check_kind(dtype: np.dtype, finite: bool, reserved: str | None) -> int | None:
    """The compiled check a field needs: a kind, -1 for none, None for no compiled form."""
    if reserved == "step_type":
        return codes.STEP_TYPES if dtype == STEP_TYPE_DTYPE else None
    if reserved == "discount":
        return codes.DISCOUNTS if dtype == DISCOUNT_DTYPE else None
    return _FINITE_KINDS.get(dtype) if finite else -1


def validated_packed(spec: SpecParts, payload: np.ndarray, packed: PackedSteps) -> ValidatedSteps:
    """:meth:`Spec.validated_packed`, which says what it returns and raises."""
    if payload.flags.writeable or payload.dtype != np.uint8 or payload.shape[0] < packed.nbytes:
        raise ConfigError("validated_packed needs a read-only uint8 payload that holds the layout")
    arrays = packed.arrays(payload)
    packed.check(spec, payload, arrays)
    return ValidatedSteps(spec, packed.lead_shape, arrays, _SEAL)


# -- sealed steps -------------------------------------------------------------------------

def _read_only(arr: np.ndarray) -> np.ndarray:
    if not arr.flags.writeable:
        return arr
    view = arr.view()  # the caller's own array keeps its flags
    view.flags.writeable = False
    return view


class ValidatedSteps(Mapping[str, np.ndarray]):
    """Steps that :meth:`Spec.validated` checked, as read-only arrays (only this module
    makes them), which :meth:`Spec.validate` of an equal spec and leading shape returns
    without checking again. Whoever owns the memory under them must not change it.

    Raises:
        TypeError: constructed directly.
    """

    __slots__ = ("_arrays", "_lead", "_spec")

    def __init__(self, spec: SpecParts, lead_shape: tuple[int, ...], arrays: dict[str, np.ndarray],
                 seal: object) -> None:
        if seal is not _SEAL:
            raise TypeError("ValidatedSteps are made by Spec.validated only")
        self._spec, self._lead, self._arrays = spec, tuple(lead_shape), arrays

    def accepted_by(self, spec: SpecParts, lead_shape: tuple[int, ...]) -> bool:
        """True when ``spec`` would accept these steps with ``lead_shape`` (checked already)."""
        return tuple(lead_shape) == self._lead and (spec is self._spec or spec._fields == self._spec._fields)

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)
