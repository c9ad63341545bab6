"""Pixels without spikes (issue 38, item 4): CleanRL's ``dqn_atari`` loop ported to MinAtar,
every add timed on its own, against stable-baselines3's buffer.

The workload: MinAtar Breakout played at random (``dqn_atari``'s first steps, epsilon 1:
episodes of about 10 steps, the stress case of frame stacking), each 10x10 frame drawn as
an 84x84 uint8 image (channel ``c`` at gray level ``40 * (c + 1)``, scaled by nearest
neighbour) and stacked by gymnasium's ``FrameStackObservation(4)``: ``(4, 84, 84)`` uint8
observations, as ``dqn_atari``'s. One env in a ``SyncVectorEnv`` (NEXT_STEP autoreset). A pool of
``POOL`` env steps is recorded once (seeded; its last reset stack is made the first one,
so the pool cycles) and replayed into each case:

* ``shardreplay``: ``ReplayBuffer(spec_from_env(envs, frame_stack=True))`` filled by
  ``GymStepWriter.step(actions, next_obs, rewards, terminations, truncations, infos)``, as
  the ported loop does;
* ``sb3``: ``ReplayBuffer(optimize_memory_usage=True, handle_timeout_termination=False)``
  filled by ``rb.add(obs, next_obs, actions, rewards, terminations, infos)``, as
  ``dqn_atari`` does.

Each case runs in its own process for ``1.5 x capacity`` adds (the fill, then half a lap
over stored steps); each add is timed alone, in this thread's CPU time and in wall time.
Per case: median, mean and worst add (after the first) over the run, the fill and the rest
(and the rest's mean by tenths); medians by place at an episode's end (``ending``: the step
whose env ended; ``after``: the next; ``reset``: the one after, the new episode's first
stored step; ``normal``: the others);
peak RSS above the process's before the buffer was made, and per stored step. A case
whose memory the machine does not have (MemAvailable) is reported as not run.

    python benchmarks/replay/bench_pixel_adds.py --cases shardreplay:100000,sb3:100000
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

POOL = 8192
FRAME_BYTES = 84 * 84
# Bytes a stored step needs at most, to tell whether a case fits (ours: 1 frame a step and
# 3 more per episode of 10; SB3: one stack a step).
NEED = {"shardreplay": 1.4 * FRAME_BYTES, "sb3": 4 * FRAME_BYTES}


def record_pool(seed: int, n: int = POOL) -> dict[str, np.ndarray]:
    """``n`` steps of the workload's env: each step's newest frame, whether its observation
    is a reset stack, action, reward, terminated, truncated."""
    import gymnasium as gym
    import minatar.gym

    minatar.gym.register_envs()
    scale = np.arange(84) * 10 // 84

    def draw(obs: np.ndarray) -> np.ndarray:
        image = (obs * (40 * np.arange(1, obs.shape[-1] + 1))).max(-1).astype(np.uint8)
        return image[scale][:, scale]

    def make() -> Any:
        env = gym.make("MinAtar/Breakout-v1")
        env = gym.wrappers.TransformObservation(env, draw, gym.spaces.Box(0, 255, (84, 84), np.uint8))
        return gym.wrappers.FrameStackObservation(env, 4)

    envs = gym.vector.SyncVectorEnv([make])
    envs.single_action_space.seed(seed)
    obs, _ = envs.reset(seed=seed)
    first = obs[0, -1]
    pool: dict[str, list[Any]] = {k: [] for k in ("frame", "reset", "action", "reward", "term", "trunc")}
    for i in range(n):
        action = np.array([envs.single_action_space.sample()])
        obs, reward, term, trunc, _ = envs.step(action)
        reset = i > 0 and bool(pool["term"][-1] or pool["trunc"][-1])  # NEXT_STEP: the reset stack
        for k, v in zip(pool, (obs[0, -1], reset, action[0], reward[0], term[0], trunc[0]), strict=True):
            pool[k].append(v)
    last = max(i for i in range(n) if pool["reset"][i])
    out = {k: np.array(v[:last + 1]) for k, v in pool.items()}
    out["frame"][last] = first  # the pool's last reset is its first: it cycles
    return out


def stacks(pool: dict[str, np.ndarray], steps: int) -> Any:
    """The env's outputs for ``steps`` steps, cycling the pool: (obs before the step,
    action, next_obs, reward, terminated, truncated, infos) as the vector env gives them."""
    n = len(pool["frame"])
    obs = np.repeat(pool["frame"][n - 1][None, None], 4, axis=1)
    for i in range(steps):
        j = i % n
        frame = pool["frame"][j][None, None]
        nxt = np.repeat(frame, 4, axis=1) if pool["reset"][j] else np.concatenate([obs[:, 1:], frame], axis=1)
        done = pool["term"][j] or pool["trunc"][j]
        infos = {"episode": {"r": np.zeros(1), "l": np.zeros(1, np.int32)}, "_episode": np.ones(1, bool)} \
            if done else {}
        yield (obs, pool["action"][j:j + 1], nxt, pool["reward"][j:j + 1].astype(np.float64),
               pool["term"][j:j + 1], pool["trunc"][j:j + 1], infos)
        obs = nxt


def run_case(name: str, capacity: int, steps: int, seed: int) -> dict[str, Any]:
    """Fill one case, timing each add; its figures."""
    pool = record_pool(seed)
    # The first add of each kind compiles or allocates: a warm-up buffer, then a fresh one.
    if name == "shardreplay":
        import shardreplay as sr

        spec = sr.Spec({"obs": sr.Field((4, 84, 84), np.uint8, frame_stack=True),  # spec_from_env's
                        "action": sr.Field((), np.int64), "reward": sr.Field((), np.float32)})

        def make(cap: int) -> Any:
            rb = sr.ReplayBuffer(spec, num_streams=1, stream_capacity=cap, seed=seed)
            writer = sr.GymStepWriter(rb, autoreset_mode="next_step")
            writer.reset(np.repeat(pool["frame"][-1][None, None], 4, axis=1))
            return lambda o, a, n, r, te, tr, i: writer.step(a, n, r, te, tr, i)
    else:
        from gymnasium import spaces
        from stable_baselines3.common.buffers import ReplayBuffer

        def make(cap: int) -> Any:
            rb = ReplayBuffer(cap, spaces.Box(0, 255, (4, 84, 84), np.uint8), spaces.Discrete(3),
                              device="cpu", optimize_memory_usage=True, handle_timeout_termination=False)
            return lambda o, a, n, r, te, tr, i: rb.add(o, n, a, r, te, [i])
    add = make(1000)
    for args in stacks(pool, 1200):
        add(*args)
    del add
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS (VmHWM) starts again from the RSS now
    base = _status_kib("VmRSS")
    add = make(capacity)
    cpu, wall = np.empty(steps, np.int64), np.empty(steps, np.int64)
    place = np.zeros(steps, np.int8)  # 1 ending, 2 after, 3 reset, 0 normal
    since = 9
    for i, args in enumerate(stacks(pool, steps)):
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        add(*args)
        cpu[i], wall[i] = time.thread_time_ns() - c0, time.perf_counter_ns() - w0
        since = 0 if args[4][0] or args[5][0] else since + 1
        place[i] = since + 1 if since < 3 else 0
    peak = _status_kib("VmHWM") - base
    stored = min(steps, capacity)
    out: dict[str, Any] = {"case": name, "capacity": capacity, "adds": steps,
                           "episodes": int(np.count_nonzero(place[1:] == 1)),
                           "rss_peak_mib": round(peak / 1024, 1),
                           "rss_bytes_per_step": round(peak * 1024 / stored, 1)}
    fill = slice(1, min(capacity, steps))
    for part, sl in (("all", slice(1, steps)), ("fill", fill), ("after_fill", slice(fill.stop, steps))):
        if sl.stop > sl.start:
            c, w = cpu[sl] / 1e3, wall[sl] / 1e3
            out[part] = {"median_us": round(float(np.median(c)), 2), "mean_us": round(float(c.mean()), 2),
                         "max_ms": round(float(c.max()) / 1e3, 2), "wall_mean_us": round(float(w.mean()), 2),
                         "wall_max_ms": round(float(w.max()) / 1e3, 2), "over_10ms_cpu": int((c > 1e4).sum())}
    for part, sl in (("fill", fill), ("after_fill", slice(fill.stop, steps))):
        if sl.stop > sl.start:
            c, p = cpu[sl] / 1e3, place[sl]
            out[part]["by_place_median_us"] = {k: round(float(np.median(c[p == v])), 2) for k, v in
                                               (("normal", 0), ("ending", 1), ("after", 2), ("reset", 3))}
    if steps > fill.stop:  # the first tenths pay what a ring first writes after the fill (page faults)
        out["after_fill"]["tenths_mean_us"] = [round(float(x.mean()) / 1e3, 2)
                                               for x in np.array_split(cpu[fill.stop:], 10)]
    return out


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="shardreplay:100000,sb3:100000",
                   help="NAME:CAPACITY,... (NAME shardreplay or sb3), run in turn, each in its own process")
    p.add_argument("--steps-factor", type=float, default=1.5, help="adds per case, times its capacity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="two small cases (a smoke run)")
    p.add_argument("--out", default=None, help="also write the JSON line here")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # a child's one case
    args = p.parse_args()
    if args.case:
        name, cap, steps = args.case.split(":")
        print(json.dumps(run_case(name, int(cap), int(steps), args.seed)))
        return
    cases = "shardreplay:3000,sb3:3000" if args.quick else args.cases
    results = []
    for case in cases.split(","):
        name, cap = case.split(":")
        steps = int(int(cap) * args.steps_factor)
        need = NEED[name] * min(steps, int(cap)) + 2**30
        load = os.getloadavg()[0]
        if name == "sb3" and importlib.util.find_spec("stable_baselines3") is None:
            results.append({"case": name, "capacity": int(cap),
                            "not_run": "stable-baselines3 is not installed (pip install -e '.[bench]')"})
            continue
        if need > _available_bytes():
            results.append({"case": name, "capacity": int(cap), "not_run": f"needs ~{need / 2**30:.1f} GiB, "
                            f"{_available_bytes() / 2**30:.1f} GiB available"})
            continue
        proc = subprocess.run([sys.executable, __file__, "--case", f"{name}:{cap}:{steps}", "--seed",
                               str(args.seed)], capture_output=True, text=True, check=True)
        results.append({**json.loads(proc.stdout.strip().splitlines()[-1]), "load_before": round(load, 1)})
    line = json.dumps({"bench": "pixel_adds", "cases": results, "uname": os.uname().machine,
                       "cpus": os.cpu_count()})
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
