"""bench_scale.py's smoke run: one JSON line with every figure of shardreplay's case."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.env import BENCHMARKS


def test_quick_run_prints_the_figures_of_a_prioritized_case() -> None:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "replay" / "bench_scale.py"), "--quick",
                           "--libs", "shardreplay", "--modes", "prioritized", "--clock", "cpu"],
                          capture_output=True, text=True, timeout=600, check=True)
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    ((capacity, by_mode),) = line["results"].items()
    got = by_mode["prioritized"]["shardreplay"]
    assert int(capacity) == 96_000
    assert got["insert_steps_per_s"] > 0 and got["rss_bytes_per_step"] > 0
    for figure in ("sample", "learner_step"):
        low, high = got[f"{figure}_us_range"]
        assert 0 < low <= got[f"{figure}_us"] <= high
        assert abs(got[f"{figure}_us_per_transition"] - got[f"{figure}_us"] / 256) < 0.002
