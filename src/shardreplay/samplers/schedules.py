"""Schedules for values that change over training, such as prioritized replay's beta."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from shardreplay.errors import ConfigError


def is_real(value: object) -> bool:
    """A real number: Python or numpy ints and floats (``np.float32(0.4)``), any
    ``numbers.Real``; not a bool (``True`` is no exponent) and not a string."""
    real = isinstance(value, numbers.Real | np.integer | np.floating)
    return real and not isinstance(value, bool | np.bool_)


@dataclass(frozen=True)
class LinearSchedule:
    """``start`` moving linearly to ``end`` over ``steps`` calls, then staying at ``end``.

    Raises:
        ConfigError: ``steps`` < 1.
    """

    start: float
    end: float
    steps: int

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"LinearSchedule needs steps >= 1, got {self.steps}")

    def __call__(self, step: int) -> float:
        frac = min(max(step, 0), self.steps) / self.steps
        return self.start + frac * (self.end - self.start)

    def to_dict(self) -> dict[str, float | int | str]:
        """JSON-ready description."""
        return {"kind": "linear", "start": self.start, "end": self.end, "steps": self.steps}


@dataclass(frozen=True)
class ConstantSchedule:
    """Always ``value``."""

    value: float

    def __call__(self, step: int) -> float:
        return self.value

    def to_dict(self) -> dict[str, float | int | str]:
        """JSON-ready description."""
        return {"kind": "constant", "value": self.value}


Schedule = LinearSchedule | ConstantSchedule


def as_schedule(value: float | Schedule, name: str, low: float, high: float) -> Schedule:
    """Turn a number or schedule into a schedule whose values lie in ``[low, high]``.

    A number may be any real number, numpy scalars included (``np.float32(0.4)``).

    Raises:
        ConfigError: a value outside ``[low, high]``, NaN, a bool, or not a number /
            schedule.
    """
    if isinstance(value, LinearSchedule | ConstantSchedule):
        sched = value
        ends = (sched.start, sched.end) if isinstance(sched, LinearSchedule) else (sched.value,)
    elif is_real(value):
        sched = ConstantSchedule(float(value))
        ends = (sched.value,)
    else:
        raise ConfigError(f"{name} must be a number in [{low}, {high}] or a LinearSchedule, got "
                          f"{value!r} of type {type(value).__name__}")
    if any(not is_real(v) or math.isnan(float(v)) for v in ends):
        raise ConfigError(f"{name} must be a number in [{low}, {high}], got {value!r} (NaN or not a number)")
    if not all(low <= v <= high for v in ends):
        raise ConfigError(f"{name} must lie in [{low}, {high}], got {value!r}")
    return sched
