"""benchmarks/offline/bench_offline.py runs in its quick mode and prints its JSON line
(figures are never asserted: RESULTS.md holds them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.env import quick_bench

pytest.importorskip("minari")
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "offline" / "bench_offline.py"


@pytest.mark.slow
def test_offline_bench_quick(tmp_path: Path) -> None:
    line = quick_bench(BENCH, tmp_path / "offline.json", timeout_s=600)
    assert line["bench"] == "offline" and len(line["cases"]) == 8
    assert {(c["kind"], c["shards"], c["format"]) for c in line["cases"]} == \
        {(k, s, f) for k in ("vector", "pixel") for s in (1, 2) for f in ("hdf5", "arrow")}
    assert set(line["versions"]) == {"plain", "versioned"}  # the policy_version field's cost
