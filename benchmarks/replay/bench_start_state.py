"""Memory of R2D2's recurrent state per stored step and per chunk step: ``h`` and ``c``
(float32 ``[H]``) as plain per-step fields against ``Field(..., at_starts=True)``
(docs/semantics.md, "Start-state fields"). Each variant fills a fresh buffer in its own
process (window 80, period 40, episodes of 50-400 steps) and reports the state's
allocated bytes per stored step, the process's resident memory per stored step, and
the encoded chunk bytes per step.

    PYTHONPATH=src python benchmarks/replay/bench_start_state.py [--quick] [--hidden 64]
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common

STREAMS, WINDOW, PERIOD, CHUNK = 8, 80, 40, 100


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _variant(at_starts: bool, steps: int, hidden: int) -> dict:
    import shardreplay as sr
    from shardreplay import testing
    from shardreplay.transport.codec import Chunk, encode

    state = sr.Field((hidden,), np.float32, at_starts=at_starts)
    spec = sr.Spec({"obs": sr.Field((4,)), "action": sr.Field((), np.int64), "reward": sr.Field(()),
                    "h": state, "c": state})
    cap = steps // STREAMS
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 401, size=(STREAMS, steps // 50 + 2))
    ends = np.cumsum(lengths, axis=1)
    types = np.ones((STREAMS, cap), np.uint8)
    for r in range(STREAMS):
        e = ends[r][ends[r] < cap]
        types[r, 0] = 0
        types[r, e - 1] = 2
        types[r, e[e < cap]] = 0
    before = _rss_bytes()
    buf = sr.ReplayBuffer(spec, num_streams=STREAMS, stream_capacity=cap, window=WINDOW, period=PERIOD)
    row = {"obs": rng.standard_normal((STREAMS, CHUNK, 4), np.float32),
           "action": np.zeros((STREAMS, CHUNK), np.int64), "reward": np.ones((STREAMS, CHUNK), np.float32),
           "h": rng.standard_normal((STREAMS, CHUNK, hidden), np.float32),
           "c": rng.standard_normal((STREAMS, CHUNK, hidden), np.float32)}
    for t in range(0, cap, CHUNK):
        buf.extend({**row, "step_type": types[:, t:t + CHUNK]})
    rss = _rss_bytes() - before
    storage = testing.shard(buf)._storage
    state_bytes = (storage.start_rows.nbytes if at_starts else
                   storage.fields["h"].nbytes + storage.fields["c"].nbytes)
    chunk = Chunk(0, 0, 0, np.arange(STREAMS), {**row, "step_type": types[:, :CHUNK],
                                                "discount": np.ones((STREAMS, CHUNK), np.float32)})
    return {"variant": "at_starts" if at_starts else "per_step", "steps": buf.num_steps,
            "starts": len(buf), "state_bytes_per_step": round(state_bytes / buf.num_steps, 2),
            "rss_bytes_per_step": round(rss / buf.num_steps, 1),
            "chunk_bytes_per_step": round(len(encode(chunk, spec)) / (STREAMS * CHUNK), 1)}


def main() -> None:
    p = common.parser(__doc__, quick="200k steps instead of 1M")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--variant", choices=["per_step", "at_starts"], help="internal: one variant, here")
    args = p.parse_args()
    steps = 200_000 if args.quick else 1_000_000
    if args.variant:  # the child: one variant in a fresh process
        print(json.dumps(_variant(args.variant == "at_starts", steps, args.hidden)))
        return
    rows = []
    for variant in ("per_step", "at_starts"):
        cmd = [sys.executable, __file__, "--variant", variant, "--hidden", str(args.hidden)]
        out = subprocess.run(cmd + (["--quick"] if args.quick else []), check=True, capture_output=True,
                             text=True).stdout
        rows.append(json.loads(out.splitlines()[-1]))
    common.emit_line({"bench": "start_state", "hidden": args.hidden, "period": PERIOD, "window": WINDOW,
                      "results": rows, "commit": common.commit(), "loadavg": common.loadavg()}, args.out)


if __name__ == "__main__":
    main()
