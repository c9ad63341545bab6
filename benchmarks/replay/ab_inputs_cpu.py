"""CPU time per call of the natural inputs (issue 38), for A/B runs in alternated processes.

``add``: bench_inputs.py's vector-spec calls of every kind (``1`` or ``8`` envs) on one
buffer; ``gym``: replay_single_env.py's ``GymStepWriter.step`` fed gymnasium's outputs (a
float64 reward) beside SB3's ``ReplayBuffer.add`` of the same steps (make bench's
``single_env_add_vs_sb3`` loop). Each kind runs ``--calls`` calls per round, the kinds in
turn, ``--rounds`` rounds; the best round's ``time.process_time`` per call is kept (the
machine is shared: CPU time, the least disturbed round). Prints one JSON line: per kind,
microseconds and the ratio to ``typed`` (``gym``: to SB3).

    PYTHONPATH=<tree>/src python benchmarks/replay/ab_inputs_cpu.py 1   # then 8, gym
"""

from __future__ import annotations

import argparse
import json
import os
import time

import bench_inputs
import numpy as np
import replay_single_env


def main() -> None:
    """Time the kinds of one path (see the module docstring) and print the JSON line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["1", "8", "gym"], help="add of 1 or 8 envs, or the one-env gym loop")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=20_000)
    args = p.parse_args()
    if args.what == "gym":
        ours, sb3 = replay_single_env.ShardReplayOneEnv(0), replay_single_env.Sb3OneEnv(0)
        ours.create(100_000)
        sb3.create(100_000)
        calls = {"gym": ours.add, "sb3": sb3.add}
    else:
        calls = bench_inputs._add_calls("vector", int(args.what), None, 100_000, np.random.default_rng(0))
        calls.pop("cuda", None)
    best = dict.fromkeys(calls, float("inf"))
    for call in calls.values():  # warm-up, untimed
        for i in range(500):
            call(i)
    for _ in range(args.rounds):
        for kind, call in calls.items():
            t0 = time.process_time()
            for i in range(args.calls):
                call(i)
            best[kind] = min(best[kind], (time.process_time() - t0) / args.calls * 1e6)
    ref = best.get("typed", best.get("sb3", 1.0))
    print(json.dumps({"what": args.what, "load": os.getloadavg()[0],
                      **{k: {"us": round(v, 3), "ratio": round(v / ref, 2)} for k, v in best.items()}}))


if __name__ == "__main__":
    main()
