"""One validation route: state dicts and checkpoint parts are held to the step rule of a
write, with the same messages, under the caller's own error type."""

from __future__ import annotations

import numpy as np
import pytest

import shardreplay as sr
from shardreplay.errors import CheckpointFormatError, ConfigError, SpecMismatchError
from shardreplay.spec.validation import check_step_values

SPEC = sr.Spec({"x": sr.Field((), np.float32)})


def _write_message(types: np.ndarray, discount: np.ndarray) -> str:
    with pytest.raises(SpecMismatchError) as info:
        SPEC.validate({"x": np.zeros(types.shape, np.float32), "step_type": types, "discount": discount},
                      types.shape)
    return str(info.value)


@pytest.mark.parametrize(("types", "discount"), [
    (np.array([0, 3], np.uint8), np.ones(2, np.float32)),
    (np.array([-1, 1], np.int8), np.ones(2, np.float32)),
    (np.array([1, 2**63 + 1], np.uint64), np.ones(2, np.float32)),
    (np.array([0, 2], np.uint16), np.array([1.0, np.nan], np.float32)),
    (np.array([1, 1], np.int64), np.array([-0.5, 1.0], np.float64)),
    (np.array([1, 1], np.int32), np.array([0.5, np.inf], np.float32)),
])
@pytest.mark.parametrize("exc", [ConfigError, CheckpointFormatError])
def test_stored_steps_are_refused_as_a_write_is(types: np.ndarray, discount: np.ndarray,
                                                exc: type[Exception]) -> None:
    with pytest.raises(exc) as info:
        check_step_values(types, discount, exc=exc, where="state arrays: ")
    assert str(info.value) == "state arrays: " + _write_message(types, discount)


def test_stored_steps_that_follow_the_rule_pass_and_non_integer_types_do_not() -> None:
    check_step_values(np.array([0, 1, 2], np.uint8), np.array([0.0, -0.0, 1.0], np.float32),
                      exc=ConfigError, where="")
    check_step_values(np.zeros(0, np.int64), np.zeros(0, np.float32), exc=ConfigError, where="")
    with pytest.raises(CheckpointFormatError, match=r"part: field 'step_type': expected integers"):
        check_step_values(np.array([1.0]), np.ones(1, np.float32), exc=CheckpointFormatError, where="part: ")
