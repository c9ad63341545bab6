"""Smoke run of benchmarks/checkpoint/bench_checkpoint.py: one JSON line with every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.env import BENCHMARKS

BENCH = BENCHMARKS / "checkpoint" / "bench_checkpoint.py"


@pytest.mark.slow  # five interpreters importing torch: ~30 s on 2 busy cores
def test_bench_checkpoint_smoke(tmp_path: Path) -> None:
    out = tmp_path / "line.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--gb", "0.02", "--repeat", "1",
                           "--dir", str(tmp_path / "scratch"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text())
    assert line["loaded_steps"] == line["steps"] > 0
    assert line["part_bytes"] >= line["data_bytes"]
    for key in ("save_ratio", "load_ratio_cold", "load_ratio_warm", "load_cpu_ratio_warm"):
        assert line[key] > 0
    assert 0.5 < line["load_rss_ratio"] < 3  # small data: page granularity and scratch show
    assert not (tmp_path / "scratch" / "ours").exists()  # scratch files removed


@pytest.mark.slow  # one interpreter importing torch, a few tiny checkpoints: ~20 s on 2 busy cores
def test_bench_checkpoint_stall_smoke(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--stall", "--gb", "0.01", "--steps", "10",
                           "--dir", str(tmp_path / "scratch")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["benchmark"] == "bench_checkpoint_stall"
    assert line["background_steps_during"] >= 1 and line["sync_longest_step_s"] > 0
    # Only the steps ingested since the previous checkpoint are written again (and the small arrays).
    inc = line["incremental_checkpoint_bytes"]
    assert line["ingested_bytes"] <= inc < 0.5 * line["full_checkpoint_bytes"]
    assert not (tmp_path / "scratch" / "stall").exists()  # scratch files removed
