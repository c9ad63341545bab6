"""Turn bench_replay.py's JSON line into the markdown table of the README.

Usage::

    python benchmarks/replay/replay_table.py .bench/bench_replay.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

LIBRARIES = ("shardreplay", "torchrl", "cpprb")
ROWS = (
    ("uniform: insert, transitions/s (batches of 32)", "uniform", "insert_tps"),
    ("uniform: insert into the full buffer (overwrite), transitions/s", "uniform", "overwrite_tps"),
    ("uniform: sample 256, batches/s", "uniform", "sample_batches_per_s"),
    ("prioritized: insert, transitions/s (batches of 32)", "prioritized", "insert_tps"),
    ("prioritized: insert into the full buffer (overwrite), transitions/s", "prioritized", "overwrite_tps"),
    ("prioritized: sample 256 with weights, batches/s", "prioritized", "sample_batches_per_s"),
    ("prioritized: update 256 priorities, calls/s", "prioritized", "update_calls_per_s"),
    ("prioritized: learner step (sample 256 + update 256), steps/s", "prioritized", "learner_steps_per_s"),
    ("uniform: buffer memory (VmRSS after fill - baseline), MiB", "uniform", "rss_mib_buffer"),
    ("prioritized: buffer memory (VmRSS after fill - baseline), MiB", "prioritized", "rss_mib_buffer"),
    ("prioritized: buffer + loaded code, MiB", "prioritized", "rss_mib_buffer_and_code"),
)


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.1f}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def table(line: dict[str, Any]) -> str:
    """The markdown table (figures per library) and the ratios with their targets."""
    libs = [lib for lib in LIBRARIES if lib in line["results"]]
    out = ["| figure | " + " | ".join(libs) + " |", "| --- |" + " ---: |" * len(libs)]
    for label, mode, key in ROWS:
        cells = []
        for lib in libs:
            res = line["results"][lib].get(mode, {})
            cells.append(_cell(res.get(key)) if key in res or not res.get("missing") else "missing")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    out += ["", "| ratio (shardreplay / peer) | medians | best blocks | target | met |",
            "| --- | ---: | ---: | ---: | --- |"]
    best = line.get("ratios_best_block", {})
    for name, value in line["ratios"].items():
        target = line["targets"].get(name, {})
        met = {True: "yes", False: "**no**", None: "n/a"}[target.get("met")] if target else ""
        out.append(f"| `{name}` | {_ratio(value)} | {_ratio(best.get(name))} | "
                   f"{target.get('target', '')} | {met} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    """Print the table of the last JSON line of each file given."""
    for path in argv if argv is not None else sys.argv[1:]:
        lines = [x for x in Path(path).read_text().splitlines() if x.startswith("{")]
        print(table(json.loads(lines[-1])))


if __name__ == "__main__":
    main()
