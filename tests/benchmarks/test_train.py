"""The training benchmark: its steady-state rates, and a tiny run's one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.env import BENCHMARKS

BENCH = BENCHMARKS / "train" / "bench_train.py"
# min-replay (1000) and then enough learning for several one-second metrics rows.
STEPS = 4000

import bench_train  # noqa: E402


def test_steady_rates_skip_the_warm_up_rows() -> None:
    rows = [{"wall_s": "1.0", "env_steps": "0", "updates": "0"},
            {"wall_s": "2.0", "env_steps": "900", "updates": "0"},     # warm-up: left out
            {"wall_s": "3.0", "env_steps": "1000", "updates": "10"},
            {"wall_s": "5.0", "env_steps": "2000", "updates": "110"}]
    assert bench_train._steady(rows) == {"env_steps_per_s": 500.0, "updates_per_s": 50.0, "seconds": 2.0}
    assert bench_train._steady(rows[:3])["updates_per_s"] is None  # one learning row: no rate


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tiny_run_prints_one_json_line(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--steps", str(STEPS), "--cases", "1:exact",
                           "--out", str(out)], capture_output=True, text=True, timeout=380, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text())
    (result,) = line["results"]
    assert (result["learners"], result["sample_mode"]) == (1, "exact")
    assert result["env_steps"] >= STEPS and result["updates"] > 0
    assert result["steady"]["updates_per_s"] > 0 and result["overall"]["env_steps_per_s"] > 0
    steady = result["steady"]
    assert steady["samples_per_s"] == pytest.approx(steady["updates_per_s"] * 64, rel=1e-3)
