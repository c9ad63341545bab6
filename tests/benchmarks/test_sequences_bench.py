"""The sequence-sampling benchmark: a quick run prints its one JSON line (no timed assertion)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.env import BENCHMARKS, quick_bench

BENCH = BENCHMARKS / "replay" / "bench_sequences.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_prints_one_json_line(tmp_path: Path) -> None:
    line = quick_bench(BENCH, tmp_path / "bench.json")
    size = line["steps_100000"]
    assert size["uniform"]["shardreplay_ms"] > 0
    assert size["r2d2_uniform_ms"] > 0 and size["r2d2_prioritized_ms"] > 0
