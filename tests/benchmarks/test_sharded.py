"""The sharded benchmark: a smoke run with 2 gloo ranks prints its one JSON line, phase
timings included (no timed assertion)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.env import BENCHMARKS

BENCH = BENCHMARKS / "sharded" / "bench_sharded.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_prints_one_json_line_with_phases(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--ranks", "2", "--prefetch", "1,8",
                           "--out", str(out)], capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text())
    world = line["ranks2"]
    for mode in ("exact", "local"):
        for prefetch in (1, 8):
            figures = world[f"{mode}_p{prefetch}"]
            assert figures["steps_per_s_per_rank"] > 0
            phases = figures["phases_ms_per_step_mean_over_ranks"]
            assert phases["local.draw"] > 0 and phases["local.gather"] > 0
    # the exact exchange unpacks the records it receives: the timer saw it
    assert world["exact_p1"]["phases_ms_per_step_mean_over_ranks"]["records.unpack"] > 0
