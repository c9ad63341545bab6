"""Before/after of ``GymStepWriter.step``: this checkout against another one (its ``src``
directory given on the command line, e.g. a ``git worktree`` of main).

Each round starts one child process per checkout, in alternating order, so that load
from other work hits both alike; a child builds one writer per field kind (vector: 4 envs
of 4 float32, a discrete action; float: 1 env of 17 float32, 6 float32 actions; pixel: 2 envs
of 4x84x84 uint8), warms it past its one-time costs and times
its steps (CPU time of its thread). Prints one JSON line: per kind, the median
microseconds per step of each checkout, and the median and range of new / old over rounds.

    git worktree add --detach /tmp/base main
    PYTHONPATH=src python benchmarks/replay/ab_gym_step.py /tmp/base/src
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# kind: envs, observation shape and dtype, action shape and dtype (float: a MuJoCo-like env).
KINDS = {"vector": (4, (4,), np.float32, (), np.int64), "float": (1, (17,), np.float32, (6,), np.float32),
         "pixel": (2, (4, 84, 84), np.uint8, (), np.int64)}
HERE = Path(__file__).resolve()


def child(calls: int) -> dict[str, float]:
    """Microseconds per ``GymStepWriter.step`` of each kind, for the shardreplay imported."""
    import shardreplay as sr

    out = {}
    for kind, (envs, shape, dtype, act_shape, act_dtype) in KINDS.items():
        spec = sr.Spec({"obs": sr.Field(shape, dtype), "action": sr.Field(act_shape, act_dtype),
                        "reward": sr.Field((), np.float32)})
        buf = sr.ReplayBuffer(spec, num_streams=envs, stream_capacity=4096, window=2, seed=0)
        writer = sr.GymStepWriter(buf, autoreset_mode="next_step")
        obs = np.ones((envs, *shape), dtype)
        writer.reset(obs)
        action = np.zeros((envs, *act_shape), act_dtype)
        reward, no = np.ones(envs, np.float32), np.zeros(envs, np.bool_)
        for _ in range(1100):  # past a buffer's lazily built one-step path
            writer.step(action, obs, reward, no, no, {})
        start = time.thread_time()
        for _ in range(calls):
            writer.step(action, obs, reward, no, no, {})
        out[kind] = (time.thread_time() - start) / calls * 1e6
    return out


def run(src: str, calls: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": src}
    proc = subprocess.run([sys.executable, str(HERE), "--child", str(calls)], env=env, capture_output=True,
                          text=True, check=True, timeout=600)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(old_src: str, rounds: int = 7, calls: int = 3000) -> dict[str, Any]:
    """Time both checkouts per kind (see the module docstring)."""
    new_src = str(HERE.parents[2] / "src")
    times: dict[str, dict[str, list[float]]] = {k: {"old": [], "new": []} for k in KINDS}
    for r in range(rounds):
        for name in (("old", "new") if r % 2 else ("new", "old")):
            got = run(old_src if name == "old" else new_src, calls)
            for kind, us in got.items():
                times[kind][name].append(us)
    out: dict[str, Any] = {"load": os.getloadavg()}
    for kind, t in times.items():
        ratios = [b / a for a, b in zip(t["old"], t["new"], strict=True)]
        out[kind] = {**{k: round(statistics.median(v), 2) for k, v in t.items()},
                     "new_vs_old": {"median": round(statistics.median(ratios), 3),
                                    "min": round(min(ratios), 3), "max": round(max(ratios), 3)}}
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(int(sys.argv[2]))))
    elif len(sys.argv) == 2:
        print(json.dumps(main(sys.argv[1])))
    else:
        sys.exit(__doc__)
