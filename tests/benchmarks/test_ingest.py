"""The ingest benchmark: its RSS summary and a quick run's one JSON line (nothing lost,
every writer counted); no timed assertion."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.support.env import BENCHMARKS, quick_bench

BENCH = BENCHMARKS / "transport" / "bench_ingest.py"

import bench_ingest  # noqa: E402


def test_rss_slope_is_taken_over_the_second_half_in_mb_per_minute() -> None:
    # Grows 100 MB while filling (first half), then 0.5 MB a second (30 MB/min).
    samples = [(float(t), 100.0 + min(t, 10) * 10 + max(t - 10, 0) * 0.5) for t in range(21)]
    got = bench_ingest.rss_summary(samples)
    assert got["rss_mb_start"] == 100 and got["rss_mb_end"] == 205 and got["rss_mb_max"] == 205
    assert got["rss_mb_per_min_second_half"] == pytest.approx(30.0)
    assert got["rss_mb_series"][0] == [0, 100] and got["rss_mb_series"][-1] == [20, 205]


def test_a_writer_s_first_step_starts_an_episode_without_touching_the_trajectory() -> None:
    obs = np.zeros((10, 4, 2, 2), np.uint8)
    types = np.ones(10, np.uint8)
    first = bench_ingest.steps_at(obs, types, 3, 4, True)
    assert first["step_type"].tolist() == [[0, 1, 1, 1]] and (types == 1).all()
    assert bench_ingest.steps_at(obs, types, 3, 4, False)["step_type"].tolist() == [[1, 1, 1, 1]]
    assert first["obs"].shape == (1, 4, 4, 2, 2)


@pytest.mark.slow
def test_quick_run_prints_one_json_line_and_loses_nothing(tmp_path: Path) -> None:
    pytest.importorskip("ale_py")  # the frames are recorded from Pong (the atari extra)
    line = quick_bench(BENCH, tmp_path / "ingest.json", timeout_s=600)
    (case,) = line["cases"]
    assert (case["transport"], case["writers"]) == ("local", 8)
    assert case["sent_chunks"] > 0 and case["lost_chunks"] == 0
    assert case["stored_chunks"] == case["sent_chunks"] == case["reader_stats"]["received"]
    assert case["reader_stats"]["rejected"] == {} and case["reader_stats"]["duplicates"] == 0
    assert len(case["writer_steps_per_s_min_median_max"]) == 3 and len(case["load_avg"]) == 2
    assert case["rss_mb_series"] and case["wire_bytes_per_step"] > 0
