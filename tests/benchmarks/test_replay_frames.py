"""The replay benchmark's Nature-DQN workload: its frame pool, its ratios, a smoke run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardreplay import testing
from tests.support.env import BENCHMARKS

BENCH_DIR = BENCHMARKS / "replay"

import replay_frames as F  # noqa: E402
import replay_workload as W  # noqa: E402


def test_frame_pool_stacks_continue_their_episodes_and_cycle() -> None:
    pool = F.make_frame_pool(seed=0)
    obs, types = pool["obs"], pool["step_type"]
    assert obs.shape == (F.POOL_CALLS, F.STREAMS, F.STACK, *F.FRAME) and obs.dtype == np.uint8
    assert (types[0] == W.FIRST).all() and np.isin(types[-1], (W.LAST, W.FIRST)).all()
    first = types == W.FIRST
    assert np.array_equal(first[1:], types[:-1] == W.LAST)
    # An episode's first stack repeats one frame; every later stack shifts one frame in.
    assert (obs[first] == obs[first][:, -1:]).all()
    cont = ~first[1:]
    assert np.array_equal(obs[1:][cont][:, :-1], obs[:-1][cont][:, 1:])
    assert 0.005 < (types == W.LAST).mean() < 0.05


def test_a_stacked_buffer_takes_the_pool_twice_round() -> None:
    case = F.make_case("shardreplay", F.make_frame_pool(seed=1))
    case.create(F.STREAMS * 64)
    for i in range(2 * F.POOL_CALLS):  # wraps the pool and each stream's ring
        case.add(i)
    batch = case.sample()
    assert tuple(batch.data["obs"].shape) == (F.SAMPLE_BATCH, 2, F.STACK, *F.FRAME)
    store = testing.shard(case.buf)._storage.stacked["obs"]
    assert store.frame_capacity == store.frames.shape[1]


def test_ratios_and_targets() -> None:
    results = {"shardreplay": {"layout_bytes_1m": 14.0, "learner_steps_per_s": 300.0,
                               "rss_bytes_per_transition": 10.0},
               "cpprb_plain": {"layout_bytes_1m": 100.0, "rss_bytes_per_transition": 50.0},
               "cpprb_stack": {"layout_bytes_1m": 12.0, "learner_steps_per_s": 250.0}}
    values, targets = F.frames_ratios(results)
    assert values["memory_1m_vs_cpprb_plain"] == 0.14
    assert values["rss_per_transition_vs_cpprb_plain"] == 0.2
    assert values["learner_step_vs_cpprb_stack"] == 1.2
    assert values["sample_vs_cpprb_stack"] is None
    assert targets["memory_1m_vs_cpprb_plain"] == {"target": "<= 0.3", "met": True}
    assert targets["learner_step_vs_cpprb_stack"] == {"target": ">= 1.0", "met": True}


def test_layout_bytes_count_one_frame_per_step() -> None:
    case = F.make_case("shardreplay", F.make_frame_pool(seed=0))
    per_step = case.layout_bytes(F.NOMINAL) / F.NOMINAL
    frame = F.FRAME[0] * F.FRAME[1]
    assert frame < per_step < 1.25 * frame  # ring margin, frame positions, records, trees


@pytest.mark.slow
def test_quick_atari_run_prints_one_json_line(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH_DIR / "bench_replay.py"), "--workload", "atari", "--quick",
         "--atari-capacity", "3200", "--libs", "shardreplay", "--calls", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = line["results"]["shardreplay"]
    assert ours["capacity"] == 3200 and ours["learner_steps_per_s"] > 0
    assert ours["layout_gib_1m"] < 8
    assert line["ratios"]["learner_step_vs_cpprb_stack"] is None  # cpprb not selected
