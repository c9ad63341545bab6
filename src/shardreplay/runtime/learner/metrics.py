"""Run metrics (rank 0): a CSV file, TensorBoard events, a live progress bar, a learning
curve; TensorBoard, rich and matplotlib are imported when used. ``policy_lag``:
docs/semantics.md ("Runs, learner lives and policy versions").
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
    """Appends rows to ``<run_dir>/metrics.csv``, TensorBoard events under ``tb/`` and,
    with ``progress``, a live bar (rich) up to ``total_env_steps``."""

    def __init__(self, run_dir: Path, total_env_steps: int, progress: bool = True) -> None:
        self.run_dir = Path(run_dir)
        path = self.run_dir / "metrics.csv"
        is_new = not path.exists()
        self._file = open(path, "a", newline="")  # noqa: SIM115 - closed in close()
        self._csv = csv.DictWriter(self._file, fieldnames=COLUMNS)
        if is_new:  # on disk at once: a reader never finds rows before their header
            self._csv.writeheader()
            self._file.flush()
        self._tb = _tensorboard(self.run_dir / "tb")
        self._bar = _Bar(total_env_steps) if progress else None

    def record(self, row: dict[str, Any], last_eval: float | None = None) -> None:
        """Write one row (missing columns stay empty) and refresh the bar (which shows
        ``last_eval``, the newest evaluation, also on rows that carry none)."""
        clean = {k: ("" if row.get(k) is None or (isinstance(row.get(k), float) and math.isnan(row[k]))
                     else row[k]) for k in COLUMNS}
        self._csv.writerow(clean)
        self._file.flush()
        if self._tb is not None:
            for key, value in clean.items():
                if key not in ("env_steps", "wall_s") and value != "":
                    self._tb.add_scalar(key, float(value), int(row["env_steps"]))
            self._tb.flush()
        if self._bar is not None:
            self._bar.update(row, last_eval)

    def close(self, outcome: str = "", final_eval: float | None = None) -> None:
        """Flush and close everything; the bar ends saying ``outcome`` (solved, env_steps,
        time or signal) with ``final_eval``."""
        if self._bar is not None:
            self._bar.close(outcome, final_eval)
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


def status_text(row: dict[str, Any], last_eval: float | None, width: int) -> str:
    """The bar's live figures, most important first, as many as fit in ``width`` columns:
    steps, training return, evaluation, then throughput, replay, ratio and lag."""
    fields = [f"{row['env_steps']:,} steps",
              f"return {_fmt(row.get('recent_return'))}",
              f"eval {_fmt(last_eval)}",
              f"{_fmt(row.get('env_steps_per_s'), 0)} steps/s",
              f"{_fmt(row.get('updates_per_s'), 0)} upd/s",
              f"replay {_fmt(row.get('replay_size'), 0)}",
              f"spi {_fmt(row.get('samples_per_insert'))}",
              f"lag {_fmt(row.get('policy_lag'))}"]
    text = fields[0]
    for f in fields[1:]:
        if len(text) + 3 + len(f) > width:
            break
        text += " | " + f
    return text


class _Bar:
    """A rich progress bar over environment steps, with the run's live figures. While it
    shows, this process's log lines are printed above it (never glued onto it)."""

    _BAR_WIDTH = 16
    _FIXED = len("train ") + _BAR_WIDTH + len(" 0:00:00") + 4  # columns besides the figures

    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._console = Console(stderr=True)
        self._progress = Progress(TextColumn("[bold]{task.description}"),
                                  BarColumn(bar_width=self._BAR_WIDTH),
                                  TextColumn("{task.fields[text]}"), TimeElapsedColumn(),
                                  console=self._console, transient=False)
        self._progress.start()
        self._task = self._progress.add_task("train", total=total, text="starting")
        self._handlers = _log_through(self._console)

    def update(self, row: dict[str, Any], last_eval: float | None) -> None:
        width = max(self._console.width - self._FIXED, 20)
        self._progress.update(self._task, completed=row["env_steps"], text=status_text(row, last_eval, width))

    def close(self, outcome: str, final_eval: float | None) -> None:
        """Finish the bar: full when the run is over (solved or its budget used up), and
        say how it ended."""
        task = self._progress.tasks[0]
        words = {"solved": "solved", "env_steps": "step budget used", "time": "time limit",
                 "signal": "stopped", "storage": "disk refused a write",
                 "actors": "every actor gave up"}
        text = f"{words.get(outcome, 'done')}: eval {_fmt(final_eval)}"
        completed = task.total if outcome in ("solved", "env_steps") else task.completed
        self._progress.update(self._task, completed=completed, text=text,
                              description="solved" if outcome == "solved" else "train")
        self._progress.stop()
        for handler, stream in self._handlers:  # as _log_through found them
            handler.setStream(stream)


def _log_through(console: Any) -> list[tuple[logging.StreamHandler, Any]]:
    """Point the root logger's stream handlers at ``console`` (printed above the live
    bar); returns what to restore."""
    changed = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            changed.append((handler, handler.setStream(_ConsoleStream(console))))
    return changed


class _ConsoleStream:
    """A text stream that prints through a rich console (above its live display)."""

    def __init__(self, console: Any) -> None:
        self._console = console

    def write(self, text: str) -> int:
        if text.strip():
            self._console.print(text.rstrip("\n"), markup=False, highlight=False, soft_wrap=True)
        return len(text)

    def flush(self) -> None:
        """Nothing to flush: rich writes at once."""


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def plot_learning_curve(run_dir: Path) -> Path | None:
    """``learning_curve.png``: returns against env steps and wall time, from metrics.csv."""
    path = Path(run_dir) / "metrics.csv"
    if not path.exists():
        return None
    # A bare Figure, not pyplot: no backend to choose, no global figure registry, less to import.
    from matplotlib.figure import Figure

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    fig = Figure(figsize=(11, 4))
    axes = fig.subplots(1, 2)
    xs_spec = ((axes[0], "env_steps", "environment steps"), (axes[1], "wall_s", "wall time (s)"))
    ys_spec = (("recent_return", "training episodes (recent mean)"), ("eval_return", "greedy evaluation"))
    for ax, xkey, xlabel in xs_spec:
        for key, label in ys_spec:
            xs, ys = curve_points(rows, xkey, key)
            if xs:
                ax.plot(xs, ys, marker="o" if key == "eval_return" else None, markersize=4, label=label)
        final = [r for r in rows if r.get("eval_return") not in (None, "")][-1:]
        if final:  # the run's last row holds its final evaluation
            ax.plot([float(final[0][xkey])], [float(final[0]["eval_return"])], marker="*", markersize=14,
                    linestyle="", color="C3", label=f"final evaluation {float(final[0]['eval_return']):.1f}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("return")
        ax.grid(alpha=0.3)
        if ax.get_lines():  # a run stopped before its first return has nothing to label
            ax.legend()
    fig.suptitle("shardreplay train: learning curve")
    fig.tight_layout()
    out = Path(run_dir) / "learning_curve.png"
    fig.savefig(out, dpi=100)
    return out


def curve_points(rows: list[dict[str, str]], xkey: str, ykey: str) -> tuple[list[float], list[float]]:
    """The points of one curve: ``ykey`` against ``xkey`` over the rows that have a
    ``ykey`` value, with a gap (NaN) wherever x goes back (a resumed life's rows are not
    joined to those its predecessor recorded after its last checkpoint)."""
    points = [(float(r[xkey]), float(r[ykey])) for r in rows if r.get(ykey) not in (None, "")]
    xs: list[float] = []
    ys: list[float] = []
    for x, y in points:
        if xs and x < xs[-1]:
            xs.append(math.nan)
            ys.append(math.nan)
        xs.append(x)
        ys.append(y)
    return xs, ys
