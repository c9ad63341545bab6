"""The run's metrics as a user sees them: the live status line at a terminal's width and
the learning curve's points (one per evaluation, a gap where a resumed run goes back)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from shardreplay.runtime.learner.metrics import (
    MetricsRecorder,
    curve_points,
    plot_learning_curve,
    status_text,
)

ROW = {"env_steps": 123_456, "updates": 4_000, "replay_size": 100_000, "env_steps_per_s": 1234.5,
       "updates_per_s": 56.7, "samples_per_insert": 31.9, "policy_lag": 2.5, "recent_return": 201.25}


def test_the_status_line_fits_the_width_and_keeps_return_and_eval_first() -> None:
    # 80 columns less the bar, its label and the clock leave about 46 for the figures.
    short = status_text(ROW, 487.5, 46)
    assert short == "123,456 steps | return 201.2 | eval 487.5"
    assert len(status_text(ROW, None, 46)) <= 46 and "eval -" in status_text(ROW, None, 46)
    wide = status_text(ROW, 487.5, 200)
    assert wide == ("123,456 steps | return 201.2 | eval 487.5 | 1,234 steps/s | 57 upd/s | "
                    "replay 100,000 | spi 31.9 | lag 2.5")
    assert status_text(ROW, 487.5, 10) == "123,456 steps"  # the step count always shows


def _rows(*values: tuple[float, int, float | None]) -> list[dict[str, str]]:
    return [{"wall_s": str(w), "env_steps": str(s), "eval_return": "" if e is None else str(e)}
            for w, s, e in values]


def test_each_evaluation_is_one_point_and_a_resume_going_back_is_not_joined() -> None:
    rows = _rows((1.0, 100, None), (2.0, 200, 10.0), (3.0, 300, None), (4.0, 400, 20.0),
                 (3.5, 350, 15.0),  # resumed from a checkpoint taken before the last rows
                 (5.0, 500, 30.0))
    xs, ys = curve_points(rows, "env_steps", "eval_return")
    assert xs[:2] == [200.0, 400.0] and math.isnan(xs[2]) and xs[3:] == [350.0, 500.0]
    assert ys[:2] == [10.0, 20.0] and math.isnan(ys[2]) and ys[3:] == [15.0, 30.0]
    assert curve_points(rows[:3], "wall_s", "eval_return") == ([2.0], [10.0])


def test_recorded_rows_keep_an_evaluation_in_its_row_only_and_the_plot_is_drawn(tmp_path: Path) -> None:
    recorder = MetricsRecorder(tmp_path, total_env_steps=1000, progress=False)
    recorder.record({**ROW, "wall_s": 1.0, "env_steps": 100, "eval_return": None}, last_eval=None)
    recorder.record({**ROW, "wall_s": 2.0, "env_steps": 200, "eval_return": 9.5}, last_eval=9.5)
    recorder.record({**ROW, "wall_s": 3.0, "env_steps": 300, "eval_return": None}, last_eval=9.5)
    recorder.record({**ROW, "wall_s": 3.5, "env_steps": 300, "eval_return": 12.0, "env_steps_per_s": None},
                    last_eval=12.0)  # the final row
    recorder.close("env_steps", 12.0)
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["eval_return"] for r in rows] == ["", "9.5", "", "12.0"]
    assert rows[-1]["env_steps_per_s"] == ""
    out = plot_learning_curve(tmp_path)
    assert out == tmp_path / "learning_curve.png" and out.stat().st_size > 10_000
