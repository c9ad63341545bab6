"""Schedules for values that change over training, such as prioritized replay's beta."""

from __future__ import annotations

from dataclasses import dataclass

from shardreplay.errors import ConfigError


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

    Raises:
        ConfigError: a value outside ``[low, high]`` or not a number / schedule.
    """
    if isinstance(value, LinearSchedule | ConstantSchedule):
        sched = value
        ends = (sched.start, sched.end) if isinstance(sched, LinearSchedule) else (sched.value,)
    elif isinstance(value, int | float):
        sched = ConstantSchedule(float(value))
        ends = (float(value),)
    else:
        raise ConfigError(f"{name} must be a number or a LinearSchedule, got {value!r}")
    if not all(low <= v <= high for v in ends):
        raise ConfigError(f"{name} must lie in [{low}, {high}], got {value!r}")
    return sched


def schedule_from_dict(d: dict) -> Schedule:
    """Inverse of ``to_dict`` of either schedule."""
    if d.get("kind") == "linear":
        return LinearSchedule(float(d["start"]), float(d["end"]), int(d["steps"]))
    return ConstantSchedule(float(d["value"]))
