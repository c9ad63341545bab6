"""The add and fill parts of ``replay_fill_sweep.py`` (FULL settings) alone, for before/after
runs of two checkouts in alternating processes (the classic single_env loop left out).

    PYTHONPATH=<checkout>/src python <checkout>/benchmarks/replay/sweep_only.py [cpu|wall] [add,fill]

Prints the ``add`` rows, then one JSON line with both parts and the load averages. Each
figure carries its median ratio and the range of its per-block ratios.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import replay_fill_sweep as F


def main(clock: str = "cpu", parts: str = "add,fill") -> dict:
    """Run the chosen parts of the sweep (see the module docstring)."""
    from gymnasium import spaces
    from stable_baselines3.common.buffers import ReplayBuffer as Sb3

    import shardreplay as sr

    F._clock = F._CLOCKS[clock]
    np.random.seed(0)  # SB3 samples from numpy's global generator
    out: dict = {"shardreplay": sr.__file__, "clock": clock, "load_before": os.getloadavg()}
    if "add" in parts:
        out["add"] = F.add_sweep(sr, Sb3, spaces, F.FULL)
        print(json.dumps(out["add"]), flush=True)
    if "fill" in parts:
        out["fill"] = F.fill_sweep(sr, Sb3, spaces, F.FULL)
    out["load_after"] = os.getloadavg()
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:3])))
