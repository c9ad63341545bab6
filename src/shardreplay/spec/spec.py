"""The Spec: every field of a step, and validation of writes against it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

import shardreplay.spec.validation as validation
from shardreplay.errors import ConfigError
from shardreplay.spec.fields import RESERVED_FIELDS, Field
from shardreplay.spec.layout import DISCOUNT_DTYPE, STEP_TYPE_DTYPE
from shardreplay.spec.validation import PackedSteps, ValidatedSteps, flatten

__all__ = ["DISCOUNT_DTYPE", "STEP_TYPE_DTYPE", "Spec", "ValidatedSteps", "flatten"]


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

    # -- validation (the route is shardreplay.spec.validation) ----------------------------
    def validate(self, step: Mapping[str, Any], lead_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        """Check a write (every user field plus ``"step_type"`` and optionally
        ``"discount"``, nested or dotted, each shaped ``lead_shape + field.shape``;
        ``lead_shape`` ``(S,)`` for ``add``, ``(S, T)`` for ``extend``) and return its
        arrays cast to the stored dtypes, flat, ``discount`` 1.0 where not given.

        Raises:
            SpecMismatchError: a missing or unknown field, wrong shape, unsafe dtype,
                NaN/inf in a finite field, a step type outside {0, 1, 2}, or a discount
                outside [0, 1]. The message names the field and what was expected.
        """
        return validation.validate(self, step, lead_shape)

    def validated(self, step: Mapping[str, Any], lead_shape: tuple[int, ...]) -> ValidatedSteps:
        """:meth:`validate`, sealed: read-only arrays that this spec accepts again unchecked
        (a decoded chunk is checked once on its way into a buffer).

        Raises:
            SpecMismatchError: as :meth:`validate`.
        """
        return validation.validated(self, step, lead_shape)

    def validated_packed(self, payload: np.ndarray, packed: PackedSteps) -> ValidatedSteps:
        """:meth:`validated` of steps packed in a read-only uint8 ``payload`` as ``packed``
        (from :func:`shardreplay.spec.validation.packed_steps` for this spec) says: one
        compiled pass over the values, views without a copy.

        Raises:
            SpecMismatchError: as :meth:`validate` (a bad value, named by its field).
            ConfigError: ``payload`` is writable, not uint8 or shorter than the layout.
        """
        return validation.validated_packed(self, payload, packed)
