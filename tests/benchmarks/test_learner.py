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


def test_ranks_hub_and_an_emulated_gpu_step_are_options() -> None:
    """``--ranks K`` sizes the threads per rank; a hub's first two hosts are the probed link,
    D apart each way when each host's link has D/2."""
    import bench_learner
    import netns

    args = bench_learner.parse_args(["--ranks", "4", "--gpu-step-ms", "5", "--hub", "--quick"])
    assert (args.ranks, args.gpu_step_ms, args.hub, args.threads) == (4, 5.0, True, 1)
    hosts = netns.Hosts(("h0", "h1", "h2", "h3"), ("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"), "hub",
                        (0, 1, 2, 3), 0.125, "tun-relay", "", relay_pids=(11, 12, 13, 14))
    probed = bench_learner._probe_link(hosts)
    assert (probed.namespaces, probed.addresses, probed.ifnames) == (("h0", "h1"), ("10.0.0.1", "10.0.0.2"),
                                                                     ("eth0", "eth0"))
    assert probed.delay_ms == 0.25
    with pytest.raises(SystemExit):
        bench_learner.parse_args(["--ranks", "1"])
