"""The learner benchmark: a smoke run prints its one JSON line (no timed assertion)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.env import BENCHMARKS

BENCH = BENCHMARKS / "train" / "bench_learner.py"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_quick_run_prints_one_json_line(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--nets", "mlp", "--out", str(out)],
                          capture_output=True, text=True, timeout=380, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text())
    assert (line["ranks"], line["backend"], line["link"]) == (2, "gloo", "loopback")
    mlp = line["nets"]["mlp"]
    for sampling in ("own", "strict", "pipelined"):
        assert mlp[f"{sampling}_steps_per_s"] > 0
    assert mlp["pipelined_over_own"] == pytest.approx(mlp["pipelined_steps_per_s"] / mlp["own_steps_per_s"],
                                                      rel=0.01)


def test_the_link_delay_flag_keeps_its_old_name() -> None:
    import bench_learner

    for flag in ("--link-delay-ms", "--netem-delay-ms"):
        args = bench_learner.parse_args([flag, "0.25", "--quick"])
        assert (args.link_delay_ms, args.link_kind) == (0.25, "auto")
    assert bench_learner.parse_args(["--link-kind", "tun-relay"]).link_kind == "tun-relay"
