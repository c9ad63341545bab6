"""What a step holds: named fields with shape and dtype, and the reserved step fields."""

from __future__ import annotations

from shardreplay.spec.fields import RESERVED_FIELDS, Field, StepType
from shardreplay.spec.spec import Spec

__all__ = ["RESERVED_FIELDS", "Field", "Spec", "StepType"]
