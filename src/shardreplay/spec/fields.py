"""One field of a step, and the step type convention (dm_env)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardreplay.errors import ConfigError

# Names the buffer stores beside the user's fields; a Spec may not define them.
RESERVED_FIELDS = ("step_type", "discount", "episode_id")
# The int64 field a training run's shards add to its spec: each step's chunk's (packed) policy version.
VERSION_FIELD = "policy_version"


class StepType(enum.IntEnum):
    """Where a step sits in its episode (dm_env convention).

    ``FIRST`` starts an episode, ``LAST`` ends it (its action is padding), ``MID`` is
    everything between. The step after a ``LAST`` starts the next episode.
    """

    FIRST = 0
    MID = 1
    LAST = 2


@dataclass(frozen=True)
class Field:
    """Shape and dtype of one field of a step (without the leading stream/time axes).

    Args:
        shape: shape of one step's value; ``()`` for a scalar.
        dtype: numpy dtype (anything ``np.dtype`` accepts); kept in this machine's byte
            order (a big-endian ``">f4"`` is stored and sampled as ``"<f4"`` here: the same
            values; chunks on the wire are little-endian either way).
        finite: for floating fields, reject NaN and inf on write.
        env_id: the field records the stream (environment) id of its step (a checkpoint
            restored onto another layout rewrites it to the new stream row).
        frame_stack: the first axis is a stack of the last ``shape[0]`` frames, oldest
            first; stored once per frame, whole stacks written and sampled
            (docs/semantics.md, "Frame-stacked fields").
        at_starts: kept only for steps that can start a window (a recurrent state, R2D2),
            sampled at the window's first step as ``[B, 1, *shape]``
            (docs/semantics.md, "Start-state fields").

    Raises:
        ConfigError: a negative dimension, an unsupported dtype, ``frame_stack`` on a
            field with fewer than one axis or an empty stack or frame, or ``at_starts``
            with ``frame_stack`` or ``env_id``.
    """

    shape: tuple[int, ...] = ()
    dtype: Any = np.float32
    finite: bool = True
    env_id: bool = False
    frame_stack: bool = False
    at_starts: bool = False

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ConfigError(f"field shape {shape} has a negative dimension")
        try:
            dtype = np.dtype(self.dtype)
        except TypeError as exc:
            raise ConfigError(f"field dtype {self.dtype!r} is not a numpy dtype") from exc
        if not dtype.isnative:  # torch and numba take native order only; the builtin descr
            dtype = np.dtype(dtype.newbyteorder("=").str)  # (dtypes are compared by identity)
        if dtype.kind not in "biuf":
            raise ConfigError(f"field dtype {dtype} is not supported: use bool, int, uint or float")
        if self.env_id and dtype.kind not in "iu":
            raise ConfigError(f"an env_id field must be an integer, not {dtype}")
        if self.frame_stack and (len(shape) < 2 or 0 in shape or self.env_id):
            raise ConfigError(f"a frame_stack field needs a shape (frames, *frame) with no empty "
                              f"axis, at least 2 axes and no env_id; got {shape}")
        if self.at_starts and (self.frame_stack or self.env_id):
            raise ConfigError("an at_starts field cannot be frame_stack or env_id: it holds a value "
                              "per window start (a recurrent state), not per step")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype)

    @property
    def checks_finite(self) -> bool:
        """True when writes must be checked for NaN/inf."""
        return self.finite and self.dtype.kind == "f"

    @property
    def stack_size(self) -> int:
        """Frames per stack (``shape[0]``) of a ``frame_stack`` field, else 0."""
        return self.shape[0] if self.frame_stack else 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (fingerprints, checkpoints, chunk headers);
        ``frame_stack`` and ``at_starts`` only when set, so plain fields keep their
        fingerprint of earlier versions."""
        d = {
            "shape": list(self.shape),
            "dtype": self.dtype.str,
            "finite": self.finite,
            "env_id": self.env_id,
        }
        if self.frame_stack:
            d["frame_stack"] = True
        if self.at_starts:
            d["at_starts"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Field:
        """Inverse of :meth:`to_dict`."""
        return cls(tuple(d["shape"]), np.dtype(d["dtype"]), bool(d["finite"]), bool(d["env_id"]),
                   bool(d.get("frame_stack", False)), bool(d.get("at_starts", False)))
