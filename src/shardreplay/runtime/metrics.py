"""Run metrics: a CSV file, TensorBoard events, a live progress bar, a learning curve.

Only rank 0 records. TensorBoard, rich and matplotlib are imported here, when used.

``policy_lag``: over the chunks all ranks ingested since the previous row, the mean of
(the learner's policy version when the chunk was ingested - the version that acted in
it, the oldest one of its steps), in learner updates (the update part of the packed
versions); empty when no chunk came in. Not clamped: a negative lag says actors acted
with a policy of an earlier learner life that got further than the checkpoint this life
resumed from.
"""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger("shardreplay.metrics")

COLUMNS = ("wall_s", "env_steps", "updates", "replay_size", "env_steps_per_s", "updates_per_s",
           "samples_per_insert", "policy_lag", "recent_return", "eval_return", "loss")


class MetricsRecorder:
    """Appends rows to ``metrics.csv``, TensorBoard events under ``tb/`` and a progress bar.

    Args:
        run_dir: the run directory.
        total_env_steps: the progress bar's total.
        progress: show the live bar (rich) on the terminal.
    """

    def __init__(self, run_dir: Path, total_env_steps: int, progress: bool = True) -> None:
        self.run_dir = Path(run_dir)
        path = self.run_dir / "metrics.csv"
        is_new = not path.exists()
        self._file = open(path, "a", newline="")  # noqa: SIM115 - closed in close()
        self._csv = csv.DictWriter(self._file, fieldnames=COLUMNS)
        if is_new:
            self._csv.writeheader()
        self._tb = _tensorboard(self.run_dir / "tb")
        self._bar = _Bar(total_env_steps) if progress else None

    def record(self, row: dict[str, Any]) -> None:
        """Write one row (missing columns stay empty) and refresh the bar."""
        clean = {k: ("" if row.get(k) is None or (isinstance(row.get(k), float) and math.isnan(row[k]))
                     else row[k]) for k in COLUMNS}
        self._csv.writerow(clean)
        self._file.flush()
        if self._tb is not None:
            for key, value in clean.items():
                if key not in ("env_steps", "wall_s") and value != "":
                    self._tb.add_scalar(key, float(value), int(row["env_steps"]))
        if self._bar is not None:
            self._bar.update(row)

    def close(self) -> None:
        """Flush and close everything."""
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        self._file.close()


def _tensorboard(directory: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("tensorboard is not installed: no TensorBoard events (pip install tensorboard)")
        return None
    return SummaryWriter(str(directory))


class _Bar:
    """A rich progress bar over environment steps, with the run's live figures."""

    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.fields[text]}"),
                                  TimeElapsedColumn(), transient=False)
        self._progress.start()
        self._task = self._progress.add_task("train", total=total, text="starting")

    def update(self, row: dict[str, Any]) -> None:
        text = (f"env {row['env_steps']:,} ({row.get('env_steps_per_s', 0):.0f}/s) | "
                f"upd {row['updates']:,} ({row.get('updates_per_s', 0):.0f}/s) | "
                f"replay {row.get('replay_size', 0):,} | spi {_fmt(row.get('samples_per_insert'))} | "
                f"lag {_fmt(row.get('policy_lag'))} | return {_fmt(row.get('recent_return'))} | "
                f"eval {_fmt(row.get('eval_return'))}")
        self._progress.update(self._task, completed=row["env_steps"], text=text)

    def close(self) -> None:
        self._progress.stop()


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.1f}"


def plot_learning_curve(run_dir: Path) -> Path | None:
    """``learning_curve.png``: returns against env steps and wall time, from metrics.csv."""
    path = Path(run_dir) / "metrics.csv"
    if not path.exists():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    xs_spec = ((axes[0], "env_steps", "environment steps"), (axes[1], "wall_s", "wall time (s)"))
    ys_spec = (("recent_return", "training episodes (recent mean)"), ("eval_return", "greedy evaluation"))
    for ax, xkey, xlabel in xs_spec:
        for key, label in ys_spec:
            pts = [(float(r[xkey]), float(r[key])) for r in rows if r.get(key) not in (None, "")]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o" if key == "eval_return" else None, label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("return")
        ax.grid(alpha=0.3)
        if ax.get_lines():  # a run stopped before its first return has nothing to label
            ax.legend()
    fig.suptitle("shardreplay train: learning curve")
    fig.tight_layout()
    out = Path(run_dir) / "learning_curve.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
