"""The client benchmark: its ratios, and a short run of both loops."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.env import BENCHMARKS

BENCH_DIR = BENCHMARKS / "train"

import bench_client  # noqa: E402


def test_summary_sums_over_seeds_before_dividing() -> None:
    runs = {"original": [{"seconds": 2.0, "cpu_seconds": 1.0}, {"seconds": 4.0, "cpu_seconds": 3.0}],
            "port": [{"seconds": 3.0, "cpu_seconds": 1.0}, {"seconds": 3.0, "cpu_seconds": 2.0}]}
    got = bench_client.summary(runs)
    assert got["ratio"] == 1.0 and got["ratio_per_seed"] == [1.5, 0.75]
    assert got["cpu_ratio"] == 0.75 and got["met"] is True
    runs["port"][1] = {"error": "child exited"}
    assert bench_client.summary(runs)["ratio"] is None and bench_client.summary(runs)["met"] is None


@pytest.mark.slow
def test_a_short_run_of_both_loops_prints_one_json_line() -> None:
    pytest.importorskip("stable_baselines3")
    cmd = [sys.executable, str(BENCH_DIR / "bench_client.py"), "--steps", "1500", "--seeds", "1",
           "--warmup-steps", "0"]  # the warm-up runs are the same children again: 10 CPU-s
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    line = json.loads(lines[0])
    for loop in ("original", "port"):
        (run,) = line["runs"][loop]
        assert run["seconds"] > 0 and run["episodes"] > 10, run
    assert line["ratio"] > 0 and line["settings"]["total_timesteps"] == 1500
