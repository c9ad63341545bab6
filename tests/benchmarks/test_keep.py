"""The keep-rollouts benchmark: a quick run prints one JSON line whose figures hold
together (kept bytes below the chunks' own for the packed pixel stacks); no timed assertion."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.env import BENCHMARKS, quick_bench

BENCH = BENCHMARKS / "transport" / "bench_keep.py"


@pytest.mark.slow
def test_quick_run_prints_one_json_line(tmp_path: Path) -> None:
    line = quick_bench(BENCH, tmp_path / "keep.json")
    vector, pixels = line["cases"]
    assert (vector["case"], pixels["case"]) == ("vector", "pixels")
    for case in (vector, pixels):
        assert case["kept_bytes_per_step"] > 0 and case["buffer_bytes_per_step"] > 0
        assert set(case["ingest_cpu_us_per_chunk"]) == {"headers", "raw", "keep"}
    assert pixels["kept_bytes_per_step"] < pixels["wire_bytes_per_step"] / 2  # frames once, then LZ4
