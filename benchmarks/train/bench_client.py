"""Client benchmark: CleanRL's DQN on shardreplay against the original on SB3's buffer.

``port`` is examples/cleanrl_dqn.py (GymStepWriter + sample_transitions); ``original``
is CleanRL's dqn.py loop with stable-baselines3's ``ReplayBuffer``, written here with
the same network, optimizer, exploration and env as the port, so the two differ only in
their replay calls. CleanRL's dqn.py targets gymnasium 0.29 (same-step autoreset,
``infos["final_observation"]``); under gymnasium >= 1.0's next-step autoreset the
original skips the step that resets the env, the usual way to keep SB3's buffer free of
transitions across episodes.

Each (loop, seed) runs in a fresh child process, the two loops alternating seed by seed
so load on the machine hits both alike, after one short untimed run of each (numba's
first compile of shardreplay's kernels happens once per installation, not per run).
Wall time is that of the training loop (env steps, replay, learning; no set-up or
evaluation); the process's CPU time over the same
span is reported beside it (steadier on a shared machine). The parent prints one JSON
line: per run figures, ``ratio`` = port seconds / original seconds summed over the seeds
(target <= 1.05), and ``cpu_ratio`` the same of CPU time.

Usage::

    python benchmarks/train/bench_client.py                  # 3 seeds x 20,000 steps
    python benchmarks/train/bench_client.py --quick          # 3 seeds x 3,000 steps
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import cleanrl_dqn as port
import common

TARGET = 1.05
WARMUP_STEPS = 1_200  # past learning_starts (1,000): every replay call runs at least once
LOOPS = ("original", "port")
CHILD_TIMEOUT_S = 1800


def bench_args(total_timesteps: int, seed: int, prioritized: bool = False) -> port.Args:
    """CleanRL's settings, shortened: learning starts after 1,000 of ``total_timesteps``."""
    return port.Args(seed=seed, total_timesteps=total_timesteps, learning_starts=1_000, eval_episodes=0,
                     prioritized=prioritized)


def train_original(args: port.Args) -> dict[str, float]:
    """CleanRL's dqn.py loop on stable-baselines3's ReplayBuffer; figures of the run."""
    import gymnasium as gym
    import numpy as np
    import torch
    import torch.nn.functional as F
    from stable_baselines3.common.buffers import ReplayBuffer

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.torch_threads)
    envs = gym.make_vec(args.env_id, num_envs=1, vectorization_mode="sync",
                        wrappers=[gym.wrappers.RecordEpisodeStatistics])
    q_network = port.QNetwork(envs)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network = port.QNetwork(envs)
    target_network.load_state_dict(q_network.state_dict())
    rb = ReplayBuffer(args.buffer_size, envs.single_observation_space, envs.single_action_space, "cpu",
                      handle_timeout_termination=False)
    start_time, start_cpu = time.perf_counter(), time.process_time()
    returns: list[float] = []
    autoreset = np.zeros(envs.num_envs, bool)

    obs, _ = envs.reset(seed=args.seed)
    for global_step in range(args.total_timesteps):
        epsilon = port.linear_schedule(args.start_e, args.end_e,
                                       int(args.exploration_fraction * args.total_timesteps), global_step)
        if random.random() < epsilon:
            actions = np.array([envs.single_action_space.sample() for _ in range(envs.num_envs)])
        else:
            q_values = q_network(torch.Tensor(obs))
            actions = torch.argmax(q_values, dim=1).numpy()
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        if "episode" in infos:
            returns += infos["episode"]["r"][infos["_episode"]].tolist()
        if not autoreset[0]:  # next-step autoreset: this step only reset the env
            rb.add(obs, next_obs, actions, rewards, terminations, [infos])
        autoreset = np.logical_or(terminations, truncations)
        obs = next_obs

        if global_step > args.learning_starts:
            if global_step % args.train_frequency == 0:
                data = rb.sample(args.batch_size)
                with torch.no_grad():
                    target_max, _ = target_network(data.next_observations).max(dim=1)
                    td_target = data.rewards.flatten() + args.gamma * target_max * (1 - data.dones.flatten())
                old_val = q_network(data.observations).gather(1, data.actions).squeeze()
                loss = F.mse_loss(td_target, old_val)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

            if global_step % args.target_network_frequency == 0:
                for target_param, q_param in zip(target_network.parameters(), q_network.parameters(),
                                                 strict=True):
                    target_param.data.copy_(args.tau * q_param.data + (1.0 - args.tau) * target_param.data)
    seconds, cpu_seconds = time.perf_counter() - start_time, time.process_time() - start_cpu
    envs.close()
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "episodes": len(returns),
            "last_returns": float(np.mean(returns[-10:])) if returns else 0.0}


def run_child(loop: str, steps: int, seed: int) -> dict[str, Any]:
    """One training run of ``loop`` in this process; its figures."""
    args = bench_args(steps, seed)
    figures = train_original(args) if loop == "original" else port.train(args)
    kept = ("seconds", "cpu_seconds", "episodes", "last_returns")
    return {k: round(v, 4) for k, v in figures.items() if k in kept}


def spawn(loop: str, steps: int, seed: int) -> dict[str, Any]:
    """Run one (loop, seed) in a fresh child; its figures or an ``error`` entry."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", loop, "--steps", str(steps),
           "--seeds", str(seed)]
    print(f"bench_client: {loop} seed {seed} ...", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"child ran past {CHILD_TIMEOUT_S} s and was killed"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"child exited with status {proc.returncode} (its stderr is above)"}
    return json.loads(lines[-1])


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Seconds per loop and the port/original ratios, of wall and of CPU time (None when a
    run failed)."""
    out: dict[str, Any] = {}
    for figure, prefix in (("seconds", ""), ("cpu_seconds", "cpu_")):
        seconds = {loop: [r.get(figure) for r in runs[loop]] for loop in LOOPS}
        ok = all(s is not None for loop in LOOPS for s in seconds[loop])
        pairs = zip(seconds["port"], seconds["original"], strict=True)
        out[figure] = seconds
        out[prefix + "ratio"] = round(sum(seconds["port"]) / sum(seconds["original"]), 3) if ok else None
        out[prefix + "ratio_per_seed"] = [round(p / o, 3) for p, o in pairs] if ok else None
    out["target"] = f"ratio <= {TARGET}"
    out["met"] = None if out["ratio"] is None else out["ratio"] <= TARGET
    return out


def main(argv: list[str] | None = None) -> None:
    """Parent: run every (loop, seed) in a child and print one JSON line; child: one run."""
    p = common.parser(__doc__, quick="3,000 steps per run")
    p.add_argument("--steps", type=int, default=20_000, help="env steps per run (default 20,000)")
    p.add_argument("--seeds", default="1,2,3", help="comma-separated seeds (default 1,2,3)")
    p.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS,
                   help=f"steps of the untimed first run of each loop (default {WARMUP_STEPS:,}; 0: none)")
    p.add_argument("--child", choices=LOOPS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    steps = 3_000 if args.quick else args.steps
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.child:
        print(json.dumps(run_child(args.child, steps, seeds[0])), flush=True)
        return
    started, load_start = common.now(), common.loadavg()
    # One short untimed run of each loop first: numba compiles shardreplay's kernels once
    # per installation (after that every process loads them from its cache), and that
    # one-time cost is not what a training run pays. It is reported as "warmup".
    warmup = {loop: spawn(loop, args.warmup_steps, seeds[0]) for loop in LOOPS if args.warmup_steps > 0}
    runs: dict[str, list[dict[str, Any]]] = {loop: [] for loop in LOOPS}
    for seed in seeds:
        for loop in LOOPS:
            runs[loop].append(spawn(loop, steps, seed))
    settings = dataclasses.asdict(bench_args(steps, seeds[0]))
    settings.pop("seed")
    line = {"benchmark": "client", "started": started, "finished": common.now(),
            "started_loadavg": load_start,
            "finished_loadavg": common.loadavg(), "cpus": common.cpus(),
            "python": common.python(), "seeds": seeds, "settings": settings, "warmup": warmup,
            "runs": runs,
            **summary(runs)}
    common.emit_line(line, args.out)


if __name__ == "__main__":
    main()
