"""What one actor costs from its start: a fresh interpreter imports the actor's entry (what
``train``'s spawned actors unpickle), takes a published CartPole policy (``--hidden``), plays
``--steps`` environment steps on 4 envs and sends their chunks to a ``file://`` spool.

Reports the median over ``--reps`` fresh processes of: CPU seconds of the imports, CPU
seconds of the whole process (interpreter start included), its peak RSS (``VmHWM``: the
actor's own, not its parent's as ``ru_maxrss`` would after ``exec``), and whether torch or
numba were loaded. Compare two trees by running this file with each on ``PYTHONPATH``
(the published policy is written by the tree under test, in a separate process). One JSON
line; a benchmark, never a timed assertion in the tests.

Usage::

    python benchmarks/startup/bench_actor_start.py                  # 5 actors of 400 steps
    python benchmarks/startup/bench_actor_start.py --reps 3 --steps 4000 --hidden 256 256
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

from common import cpus, emit_line, loadavg, median, parser, python

# Publishes a CartPole Q-network (torch: the learner's side) once.
PUBLISH = """
import sys, torch
from shardreplay.policy import open_publisher
from shardreplay.runtime.algos.networks import QNetwork
torch.manual_seed(0)
net = QNetwork(4, 2, tuple(int(h) for h in sys.argv[2:]))
open_publisher(sys.argv[1]).publish(1, {k: v.detach() for k, v in net.state_dict().items()})
"""

# One actor: argv = policy URL, spool URL, steps, hidden sizes...
ACTOR = """
import json, sys, threading, time
t0 = time.process_time()
from shardreplay.runtime.actor.processes import _actor_main  # what spawn unpickles
from shardreplay.runtime.actor.loop import ActorSettings, run
t1 = time.process_time()
s = ActorSettings(actor_id=0, num_actors=1, num_shards=1, policy_url=sys.argv[1], transport=sys.argv[2],
                  max_env_steps=int(sys.argv[3]), hidden=tuple(int(h) for h in sys.argv[4:]), seed=1,
                  queued_chunks_per_actor=1_000_000)
counters = run(s, stop=threading.Event())
cpu = time.process_time()
with open("/proc/self/status") as f:
    hwm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(json.dumps({"import_cpu_s": t1 - t0, "cpu_s": cpu, "peak_rss_mib": hwm_kib / 1024,
                  "chunks": counters["chunks"], "torch": "torch" in sys.modules,
                  "numba": "numba" in sys.modules}))
"""


def _python(code: str, *args: str) -> str:
    """Run ``code`` in a fresh interpreter with this one's ``sys.path``; its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=600, check=True).stdout


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, reps=5, reps_help="fresh actor processes (median of each figure)")
    p.add_argument("--steps", type=int, default=400, help="environment steps each actor plays")
    p.add_argument("--hidden", type=int, nargs="+", default=[16], help="the Q-network's hidden sizes")
    args = p.parse_args(argv)
    hidden = [str(h) for h in args.hidden]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        policy = f"file://{tmp}/policy"
        _python(PUBLISH, policy, *hidden)
        for rep in range(args.reps):
            out = _python(ACTOR, policy, f"file://{tmp}/spool-{rep}", str(args.steps), *hidden)
            runs.append(json.loads(out.strip().splitlines()[-1]))
    line: dict[str, Any] = {"bench": "actor_start", "reps": args.reps, "steps": args.steps,
                            "hidden": args.hidden, "python": python(), "cpus": cpus(), "loadavg": loadavg()}
    for key in ("import_cpu_s", "cpu_s", "peak_rss_mib"):
        line[key] = median((r[key] for r in runs), 3)
    line["torch"] = any(r["torch"] for r in runs)
    line["numba"] = any(r["numba"] for r in runs)
    emit_line(line, args.out)


if __name__ == "__main__":
    main()
