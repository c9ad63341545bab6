"""Ranks that disagree fail at construction, by name (issue 19.7).

One spawn of 3 real gloo ranks constructs a ShardedReplayBuffer per case, one rank
(rank 1 or 2 by turns) differing in one setting; every rank must raise ConfigError naming
that setting at construction, within seconds, and stay in step for the next case. A
last case differs only in num_streams and stream_capacity (allowed: ``shardreplay train``
gives 16 streams over 3 shards 6, 5, 5 rows of equal total capacity) and must construct
and sample. Costs one 3-rank spawn (~10 s on 2 cores).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

import shardreplay as sr
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.errors import ConfigError
from shardreplay.samplers.schedules import LinearSchedule
from tests.support import run_ranks

# One spawn: ~10 s on an idle box, ~30 s on a loaded 2-core one.
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 3
BASE: dict[str, Any] = {"dtype": np.float32, "shape": (), "extra": False, "num_streams": 2,
                        "stream_capacity": 16, "window": 2, "sampler": "prioritized", "alpha": 0.6,
                        "beta": 0.4, "mode": "exact", "prefetch": 1, "pipeline": False}
# (case, the differing rank's setting, what the message must name)
CASES: list[tuple[str, dict[str, Any], str]] = [
    ("dtype", {"dtype": np.float64}, "field 'obs' has different dtype"),
    ("shape", {"shape": (3,)}, "field 'obs' has different shape"),
    ("field", {"extra": True}, "field 'extra' is only on ranks"),
    ("sampler", {"sampler": "uniform"}, "different samplers"),
    ("alpha", {"alpha": 0.7}, "different alphas"),
    ("beta", {"beta": 0.5}, "different beta schedules (start)"),
    ("beta_steps", {"beta": LinearSchedule(0.4, 1.0, 10)}, "different beta schedules"),
    ("window", {"window": 3}, "different windows"),
    ("mode", {"mode": "local"}, "different modes"),
    ("prefetch", {"prefetch": 2}, "different prefetch depths"),
    ("pipeline", {"pipeline": True}, "different pipeline settings"),
]


def _buffer(settings: dict[str, Any], rank: int) -> ShardedReplayBuffer:
    fields = {"obs": sr.Field(settings["shape"], settings["dtype"])}
    if settings["extra"]:
        fields["extra"] = sr.Field((), np.int32)
    local = sr.ReplayBuffer(sr.Spec(fields), num_streams=settings["num_streams"],
                            stream_capacity=settings["stream_capacity"], window=settings["window"],
                            sampler=settings["sampler"], alpha=settings["alpha"], beta=settings["beta"],
                            seed=rank)
    return ShardedReplayBuffer(local, timeout_s=20, mode=settings["mode"], prefetch=settings["prefetch"],
                               pipeline=settings["pipeline"])


def _ranks(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, (name, change, _) in enumerate(CASES):
        odd = 1 + i % (world - 1)  # rank 1 or 2 differs, by turns
        settings = {**BASE, **change} if rank == odd else BASE
        start = time.monotonic()
        try:
            buf = _buffer(settings, rank)
            buf.close()
            out[name] = ("constructed", time.monotonic() - start)
        except ConfigError as exc:
            out[name] = (str(exc), time.monotonic() - start)
    # Allowed: shards of different rows (16 streams over 3 shards: 6, 5, 5; as train sizes them).
    rows = 6 if rank == 0 else 5
    buf = _buffer({**BASE, "num_streams": rows, "stream_capacity": 96 // rows}, rank)
    for t in range(4):
        buf.add({"obs": np.full(buf.local.num_streams, t, np.float32),
                 "step_type": np.full(buf.local.num_streams, 0 if t == 0 else 1, np.uint8),
                 "discount": np.ones(buf.local.num_streams, np.float32)})
    out["rows"] = buf.sample(32).mask.shape[0]
    buf.close()
    return out


def test_ranks_with_different_settings_fail_at_construction_by_name():
    results = run_ranks(_ranks, WORLD, timeout_s=120)
    for name, _, named in CASES:
        for rank, r in enumerate(results):
            message, seconds = r[name]
            assert named in message, f"case {name}, rank {rank}: {message}"
            assert "every rank" in message or "same" in message, message
            assert seconds < 10, f"case {name}, rank {rank} took {seconds:.1f} s"
    assert [r["rows"] for r in results] == [32] * WORLD
