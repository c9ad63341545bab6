"""The input-matrix benchmark: a quick run prints its one JSON line with every kind of
every path and the peers it could import, and its table names them (no timed assertion)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.env import BENCHMARKS, quick_bench

BENCH = BENCHMARKS / "replay" / "bench_inputs.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_prints_one_json_line_and_its_table(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    line = quick_bench(BENCH, out)
    kinds = {(c["path"], c["spec"], c["envs"]): set() for c in line["cases"]}
    for c in line["cases"]:
        kinds[(c["path"], c["spec"], c["envs"])].add(c["kind"])
        assert c["median_us"] > 0 and c["worst_us"] >= c["median_us"] and c["calls"] > 0
        assert c["cpu_mean_us"] > 0 and c["ratio_cpu"] > 0
    readme = {"typed", "readme", "float64", "strided", "discount_bool", "lists", "torch"}
    assert readme <= kinds[("add", "vector", 1)] and "scalars" in kinds[("add", "vector", 1)]
    assert readme <= kinds[("add", "vector", 8)] and readme <= kinds[("extend", "vector", 8)]
    for spec in ("vector", "float", "pixel"):
        assert {"typed", "gymnasium", "list_action", "torch"} <= kinds[("gym", spec, 1)]
    typed = [c for c in line["cases"] if c["kind"] == "typed"]
    assert all(c["ratio_median"] == 1.0 for c in typed)
    assert {p["peer"] for p in line["peers"]} <= {"sb3", "torchrl"}
    table = subprocess.run([sys.executable, str(BENCH), "--table", str(out)], capture_output=True, text=True,
                           timeout=60, check=True).stdout
    assert table.count("\n| add |") == 2 and "| gym | pixel |" in table and "readme" in table.splitlines()[0]
