"""The pixel-add benchmark (issue 38, item 4): a quick run prints its one JSON line with
each case's figures by place at an episode's end (no timed assertion)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.env import BENCHMARKS, quick_bench


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_prints_one_json_line_with_every_place(tmp_path: Path) -> None:
    line = quick_bench(BENCHMARKS / "replay" / "bench_pixel_adds.py", tmp_path / "bench.json")
    assert [c["case"] for c in line["cases"]] == ["shardreplay", "sb3"]
    ours = line["cases"][0]
    assert ours["episodes"] > 100 and ours["rss_bytes_per_step"] > 0  # MinAtar Breakout: short episodes
    for part in ("fill", "after_fill"):
        places = ours[part]["by_place_median_us"]
        assert set(places) == {"normal", "ending", "after", "reset"} and min(places.values()) > 0
        assert ours[part]["max_ms"] >= ours[part]["median_us"] / 1e3
    assert len(ours["after_fill"]["tenths_mean_us"]) == 10
    sb3 = line["cases"][1]
    assert "not_run" in sb3 or sb3["all"]["median_us"] > 0
