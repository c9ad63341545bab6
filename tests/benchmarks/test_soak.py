"""The soak (``benchmarks/soak/soak.py``) in short: 16 writers, 2 learner ranks over
Redis, a minute and a half of chunks flowing with one learner kill, a redis-server
restart and writer kills; the loss audit and the fairness must hold, and nothing it
started may be left running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.support.env import BENCHMARKS

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.redis]


@pytest.mark.timeout(1200)
def test_short_soak_loses_nothing_and_stays_fair(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "soak" / "soak.py"), "--actors", "16",
                           "--minutes", "1.5", "--transports", "redis", "--actor-kill-s", "20",
                           "--learner-kill-s", "50", "--redis-restart-at", "0.3", "--sample-s", "10",
                           "--dir", str(tmp_path)], capture_output=True, text=True, timeout=1150, check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])["redis"]
    faults = " ".join(result["faults"])
    assert "writer" in faults and "learner" in faults and "redis-server" in faults, result["faults"]
    assert result["launches"] >= 2, result  # the learner's death ended a launch; --auto-resume went on
    assert result["delivered"] > 0 and result["unexplained"] == 0, result
    assert result["duplicate_steps"] == 0 and result["acknowledged_lost"] == 0, result
    assert result["dropped_steps"] == 0, result
    assert result["fairness_max_min"] <= 2.0, result["chunks_per_actor_min_median_max"]
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if str(tmp_path) in " ".join(p.info["cmdline"] or []):
            left.append(p.info["pid"])
    assert left == [], f"processes of the soak left running: {left}"
