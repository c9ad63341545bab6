"""The sequence-sampling benchmark: a quick run prints its one JSON line (no timed assertion)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.env import BENCHMARKS

BENCH = BENCHMARKS / "replay" / "bench_sequences.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_prints_one_json_line(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(out)], capture_output=True,
                          text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text())
    size = line["steps_100000"]
    assert size["uniform"]["shardreplay_ms"] > 0
    assert size["r2d2_uniform_ms"] > 0 and size["r2d2_prioritized_ms"] > 0
