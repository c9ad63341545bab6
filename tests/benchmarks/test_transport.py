"""The transport benchmark: its chunks are valid, and a tiny run prints one sane JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.env import BENCHMARKS

BENCH = BENCHMARKS / "transport" / "bench_transport.py"

import bench_transport  # noqa: E402

from shardreplay.transport import decode, encode  # noqa: E402


def test_workload_chunks_round_trip_and_are_whole_episodes() -> None:
    for chunk in bench_transport.make_chunks(1):
        back = decode(encode(chunk, bench_transport.SPEC), bench_transport.SPEC, max_bytes=1 << 30)
        st = back.steps["step_type"]
        assert st.shape == (bench_transport.S, bench_transport.T)
        assert (st[:, 0] == 0).all() and (st[:, -1] == 2).all() and (st[:, 1:-1] == 1).all()
        assert back.steps["obs"].shape == (8, 32, 64)


@pytest.mark.slow
@pytest.mark.redis
def test_tiny_run_prints_one_json_line(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--chunks", "20", "--reps", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text())
    assert set(line["results"]) == {"local", "file", "redis"}
    for result in line["results"].values():
        rates = result["steps_per_s"]
        assert rates["transport"] > 0 and rates["transport_ingest"] > 0
        assert any(k.startswith("bare_") for k in rates)
        assert result["ratio"] > 0
