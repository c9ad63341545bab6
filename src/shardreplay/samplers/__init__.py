"""Samplers: which valid window starts to draw, and with what probability."""

from __future__ import annotations

from shardreplay.samplers.base import Draw
from shardreplay.samplers.fifo import FifoSampler
from shardreplay.samplers.prioritized import PrioritizedSampler, SumMinTree
from shardreplay.samplers.schedules import ConstantSchedule, LinearSchedule, as_schedule
from shardreplay.samplers.uniform import UniformSampler

SAMPLER_NAMES = ("uniform", "prioritized", "fifo")
Sampler = UniformSampler | PrioritizedSampler | FifoSampler  # every sampler a buffer can have

__all__ = [
    "SAMPLER_NAMES",
    "ConstantSchedule",
    "Draw",
    "FifoSampler",
    "LinearSchedule",
    "PrioritizedSampler",
    "Sampler",
    "SumMinTree",
    "UniformSampler",
    "as_schedule",
]
