"""The Spec: every field of a step, and validation of writes against it."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numba
import numpy as np

from shardreplay.errors import ConfigError, SpecMismatchError
from shardreplay.spec.fields import RESERVED_FIELDS, Field
from shardreplay.spec.packed import PackedLayout, max_masked, packed_values_ok

_SEP = "."
STEP_TYPE_DTYPE = np.dtype(np.uint8)
DISCOUNT_DTYPE = np.dtype(np.float32)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings into ``{"a.b": leaf}``; leaves are anything else."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"field names must be non-empty strings, got {key!r}")
        name = prefix + key
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + _SEP))
        else:
            flat[name] = value
    return flat


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`flatten`: ``{"a.b": x}`` -> ``{"a": {"b": x}}``."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split(_SEP)
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _as_field(name: str, value: Any) -> Field:
    if isinstance(value, Field):
        return value
    if isinstance(value, tuple) and len(value) == 2:
        return Field(shape=value[0], dtype=value[1])
    raise ConfigError(f"field {name!r}: expected a Field or (shape, dtype), got {value!r}")


class Spec:
    """Named fields of a step, each with a shape and dtype.

    Names may be nested: ``Spec({"obs": {"pos": Field((3,))}})`` defines the field
    ``"obs.pos"``. Writes may use the nested or the dotted form. ``step_type``,
    ``discount`` and ``episode_id`` are reserved: the buffer stores them itself.

    Raises:
        ConfigError: no fields, a reserved or malformed name, or a bad Field.
    """

    def __init__(self, fields: Mapping[str, Any]) -> None:
        flat = flatten(fields)
        if not flat:
            raise ConfigError("a Spec needs at least one field")
        for name in flat:
            if name in RESERVED_FIELDS:
                raise ConfigError(f"field name {name!r} is reserved: the buffer stores it itself")
        self._fields = {name: _as_field(name, v) for name, v in flat.items()}
        # What validate() needs per field, looked up once instead of on every write.
        self._plan = tuple((name, f.dtype, f.shape, f.checks_finite) for name, f in self._fields.items())

    # -- mapping-like access ------------------------------------------------------------
    @property
    def fields(self) -> dict[str, Field]:
        """The user fields, by dotted name (a copy)."""
        return dict(self._fields)

    @property
    def names(self) -> tuple[str, ...]:
        """Dotted names of the user fields, in definition order."""
        return tuple(self._fields)

    @property
    def env_id_fields(self) -> tuple[str, ...]:
        """Names of fields declared to hold the stream (env) id."""
        return tuple(n for n, f in self._fields.items() if f.env_id)

    def __getitem__(self, name: str) -> Field:
        return self._fields[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __contains__(self, name: object) -> bool:
        return name in self._fields

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Spec) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}: {f.dtype}{list(f.shape)}" for n, f in self._fields.items())
        return f"Spec({inner})"

    # -- serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready description, inverse of :meth:`from_dict`."""
        return {name: f.to_dict() for name, f in self._fields.items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Spec:
        """Rebuild a Spec from :meth:`to_dict` output.

        Raises:
            ConfigError: the description is malformed.
        """
        try:
            return cls({name: Field.from_dict(f) for name, f in d.items()})
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"malformed spec description: {exc}") from exc

    @property
    def fingerprint(self) -> str:
        """A short stable hash of the spec: equal specs give equal fingerprints."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # -- validation ---------------------------------------------------------------------
    def validated(self, step: Mapping[str, Any], lead_shape: tuple[int, ...]) -> ValidatedSteps:
        """:meth:`validate`, sealed: read-only arrays that this spec accepts again unchecked.

        The chunk decoder uses it so that a chunk is checked once on its way from the
        wire into a buffer (``ReplayBuffer.extend`` validates again, for free).

        Raises:
            SpecMismatchError: as :meth:`validate`.
        """
        arrays = self.validate(step, lead_shape)
        return ValidatedSteps(self, lead_shape, {k: _read_only(v) for k, v in arrays.items()}, _SEAL)

    def packed_layout(self, lead_shape: tuple[int, ...], offsets: Mapping[str, int]) -> PackedLayout | None:
        """Where the steps sit in a byte buffer, for :meth:`validated_packed`.

        Args:
            lead_shape: ``(S,)`` or ``(S, T)``.
            offsets: byte offset of every user field, ``step_type`` and ``discount``,
                each a multiple of 8 (dtypes and shapes are this spec's).

        Returns:
            The layout, or None when a field's value check has no compiled form
            (a finite float16 field, say): validate views with :meth:`validated` then.

        Raises:
            ConfigError: a field's offset is missing or not a multiple of 8.
        """
        fields = [(n, f.dtype, f.shape, f.checks_finite, None) for n, f in self._fields.items()]
        fields += [("step_type", STEP_TYPE_DTYPE, (), False, "step_type"),
                   ("discount", DISCOUNT_DTYPE, (), False, "discount")]
        views, plan = [], []
        for name, dtype, shape, finite, reserved in fields:
            offset = offsets.get(name)
            if not isinstance(offset, int) or offset < 0 or offset % 8:
                raise ConfigError(f"packed field {name!r} needs an offset that is a multiple of 8, "
                                  f"got {offset!r}")
            kind = PackedLayout.check_kind(dtype, finite, reserved)
            if kind is None:
                return None
            full = tuple(lead_shape) + shape
            views.append((name, dtype, full, offset))
            if kind >= 0:
                plan.append((kind, offset, math.prod(full)))
        return PackedLayout(lead_shape, views, plan)

    def validated_packed(self, payload: np.ndarray, layout: PackedLayout) -> ValidatedSteps:
        """:meth:`validated` of steps packed in a read-only uint8 ``payload`` as
        ``layout`` (from this spec's :meth:`packed_layout`) says: one compiled pass over
        the values, views without a copy.

        Raises:
            SpecMismatchError: as :meth:`validate` (a bad value, named by its field).
            ConfigError: ``payload`` is writable, not uint8 or shorter than the layout.
        """
        if payload.flags.writeable or payload.dtype != np.uint8 or payload.shape[0] < layout.nbytes:
            raise ConfigError("validated_packed needs a read-only uint8 payload that holds the layout")
        arrays = layout.arrays(payload)
        if not packed_values_ok(payload, layout.plan):
            return self.validated(arrays, layout.lead_shape)  # raises, naming the field
        return ValidatedSteps(self, layout.lead_shape, arrays, _SEAL)

    def validate(self, step: Mapping[str, Any], lead_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        """Check a write and return its arrays cast to the stored dtypes.

        Args:
            step: every user field plus ``"step_type"`` and optionally ``"discount"``,
                nested or dotted, each an array of shape ``lead_shape + field.shape``.
            lead_shape: ``(S,)`` for :meth:`ReplayBuffer.add`, ``(S, T)`` for ``extend``.

        Returns:
            Flat dict with every user field, ``step_type`` (uint8) and ``discount``
            (float32, 1.0 where not given).

        Raises:
            SpecMismatchError: a missing or unknown field, wrong shape, unsafe dtype,
                NaN/inf in a finite field, a step type outside {0, 1, 2}, or a discount
                outside [0, 1]. The message names the field and what was expected.
        """
        if type(step) is ValidatedSteps and step.accepted_by(self, lead_shape):
            return dict(step._arrays)
        try:
            values = [step[name] for name in self._fields]
            types = step["step_type"]
        except KeyError:
            values, types = None, None
        if values is None or len(step) != len(self._fields) + 1 + ("discount" in step):
            flat = self._check_names(step)
            values, types = [flat[name] for name in self._fields], flat["step_type"]
            step = flat
        out = {}
        for (name, dtype, shape, finite), value in zip(self._plan, values, strict=True):
            out[name] = _checked(name, value, dtype, lead_shape + shape, finite)
        types = _step_type_array(types, lead_shape)
        discount = _discount_array(step.get("discount"), lead_shape)
        # The usual dtypes: both value checks in one compiled call. Otherwise, or when it
        # fails, the separate checks below find (and name) the bad field.
        if not (types.dtype in _COMPILED_INTS and discount.dtype == DISCOUNT_DTYPE
                and _types_and_discounts_ok(types.reshape(-1), discount.reshape(-1))):
            _check_step_types(types)
            _check_discounts(discount)
        out["step_type"] = types.astype(STEP_TYPE_DTYPE, copy=False)
        out["discount"] = discount
        return out

    def _check_names(self, step: Mapping[str, Any]) -> Mapping[str, Any]:
        """Flatten a nested step and check its names; raise on missing or unknown ones."""
        flat = flatten(step) if any(isinstance(v, Mapping) for v in step.values()) else step
        missing = [n for n in (*self._fields, "step_type") if n not in flat]
        if missing:
            raise SpecMismatchError(f"missing field(s) {missing}; a step needs {list(self._fields)} "
                                    "plus 'step_type' (and optionally 'discount')")
        unknown = [n for n in flat if n not in self._fields and n not in ("step_type", "discount")]
        if unknown:
            raise SpecMismatchError(f"unknown field(s) {unknown}; the spec has {list(self._fields)}")
        return flat


_SEAL = object()


def _read_only(arr: np.ndarray) -> np.ndarray:
    if not arr.flags.writeable:
        return arr
    view = arr.view()  # the caller's own array keeps its flags
    view.flags.writeable = False
    return view


class ValidatedSteps(Mapping[str, np.ndarray]):
    """Steps that :meth:`Spec.validated` checked, as read-only arrays.

    Only ``Spec.validated`` makes them. ``Spec.validate`` returns their arrays without
    checking again when it is the same spec (or an equal one) and the same leading
    shape. The arrays cannot be changed through these views; whoever owns the memory
    under them must not change it either (the chunk decoder's input is immutable bytes).

    Raises:
        TypeError: constructed directly.
    """

    __slots__ = ("_arrays", "_lead", "_spec")

    def __init__(self, spec: Spec, lead_shape: tuple[int, ...], arrays: dict[str, np.ndarray],
                 seal: object) -> None:
        if seal is not _SEAL:
            raise TypeError("ValidatedSteps are made by Spec.validated only")
        self._spec, self._lead, self._arrays = spec, tuple(lead_shape), arrays

    def accepted_by(self, spec: Spec, lead_shape: tuple[int, ...]) -> bool:
        """True when ``spec`` would accept these steps with ``lead_shape`` (checked already)."""
        return tuple(lead_shape) == self._lead and (spec is self._spec or spec._fields == self._spec._fields)

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)


def _checked(name: str, value: Any, dtype: np.dtype, shape: tuple[int, ...],
             finite: bool) -> np.ndarray:
    arr = value if isinstance(value, np.ndarray) else _to_numpy(value)
    if arr.shape != shape:
        raise SpecMismatchError(f"field {name!r}: expected shape {shape}, got {arr.shape}")
    if arr.dtype != dtype:
        arr = _cast(name, arr, dtype)
    if finite and arr.size and not _is_finite(arr):
        raise SpecMismatchError(f"field {name!r} contains NaN or inf; it was declared finite "
                                "(Field(finite=False) allows them)")
    return arr


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _all_in_0_to_1(flat: np.ndarray) -> bool:  # pragma: no cover - compiled
    bad = False
    for i in range(flat.shape[0]):
        bad |= not (flat[i] >= 0 and flat[i] <= 1)  # NaN fails both; no early exit: vectorised
    return not bad


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _types_and_discounts_ok(types: np.ndarray, discount: np.ndarray) -> bool:  # pragma: no cover
    bad = False
    for i in range(types.shape[0]):
        bad |= types[i] > 2 or types[i] < 0
    for i in range(discount.shape[0]):
        bad |= not (discount[i] >= 0 and discount[i] <= 1)  # NaN fails both
    return not bad


@numba.njit(cache=True, nogil=True)
def _all_in_0_to_2(flat: np.ndarray) -> bool:
    for x in flat:  # noqa: SIM110 - a loop numba compiles (no generators)
        if x < 0 or x > 2:
            return False
    return True


def _is_finite(arr: np.ndarray) -> bool:
    """No NaN or inf (compiled for float32/64: one pass over the bits, no temporary)."""
    exponent = _EXPONENT_MASKS.get(arr.dtype)
    if exponent is not None:  # NaN and inf are the values whose exponent bits are all ones
        bits_dtype, mask = exponent
        return bool(max_masked(arr.reshape(-1).view(bits_dtype), mask) != mask)
    return bool(np.isfinite(arr).all())


def _step_types_ok(arr: np.ndarray) -> bool:
    """Every value in {0, 1, 2} (compiled for the usual integer dtypes)."""
    if arr.dtype in _COMPILED_INTS:
        return bool(_all_in_0_to_2(arr.reshape(-1)))
    return bool(arr.min() >= 0 and arr.max() <= 2)


_EXPONENT_MASKS = {np.dtype(np.float32): (np.dtype(np.uint32), np.uint32(0x7F800000)),
                   np.dtype(np.float64): (np.dtype(np.uint64), np.uint64(0x7FF0000000000000))}
_COMPILED_INTS = (np.dtype(np.uint8), np.dtype(np.int32), np.dtype(np.int64))


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch here
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _cast(name: str, arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    # Integers go into any integer field whose range holds the values (int64 -> uint8 is
    # the common case of Python ints); numpy's same_kind would refuse signed -> unsigned.
    int_to_int = dtype.kind in "iu" and arr.dtype.kind in "iub"
    if not int_to_int and not np.can_cast(arr.dtype, dtype, casting="same_kind"):
        raise SpecMismatchError(f"field {name!r}: cannot cast {arr.dtype} to {dtype} safely "
                                f"(expected {dtype})")
    if int_to_int and arr.size and not np.can_cast(arr.dtype, dtype, casting="safe"):
        info = np.iinfo(dtype)
        if arr.min() < info.min or arr.max() > info.max:
            raise SpecMismatchError(f"field {name!r}: values outside the range of {dtype}")
    return arr.astype(dtype)


def _step_type_array(value: Any, lead_shape: tuple[int, ...]) -> np.ndarray:
    """Step types as an integer array of ``lead_shape`` (values checked by the caller)."""
    arr = value if isinstance(value, np.ndarray) else _to_numpy(value)
    if arr.shape != lead_shape:
        raise SpecMismatchError(f"field 'step_type': expected shape {lead_shape}, got {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise SpecMismatchError(f"field 'step_type': expected integers 0/1/2 (StepType), got {arr.dtype}")
    return arr


def _check_step_types(arr: np.ndarray) -> None:
    if arr.size and not _step_types_ok(arr):
        raise SpecMismatchError("field 'step_type': values must be FIRST=0, MID=1 or LAST=2")


_ONES: dict[tuple[int, ...], np.ndarray] = {}


def _discount_array(value: Any, lead_shape: tuple[int, ...]) -> np.ndarray:
    """Discounts as float32 of ``lead_shape``, 1 where not given (values checked by the caller)."""
    if value is None:
        ones = _ONES.get(lead_shape)
        if ones is None:
            ones = _ONES[lead_shape] = np.ones(lead_shape, DISCOUNT_DTYPE)
            ones.flags.writeable = False
        return ones
    arr = value if isinstance(value, np.ndarray) else _to_numpy(value)
    if arr.shape != lead_shape:
        raise SpecMismatchError(f"field 'discount': expected shape {lead_shape}, got {arr.shape}")
    if arr.dtype.kind not in "biuf":
        raise SpecMismatchError(f"field 'discount': expected numbers in [0, 1], got {arr.dtype}")
    return arr.astype(DISCOUNT_DTYPE, copy=False)


def _check_discounts(arr: np.ndarray) -> None:
    if arr.size and not _all_in_0_to_1(arr.reshape(-1)):
        raise SpecMismatchError("field 'discount': values must be finite and in [0, 1] "
                                "(0 at a termination, 1 at a truncation and elsewhere)")
