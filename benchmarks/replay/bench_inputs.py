"""The input matrix: what users pass to ``add``, ``extend`` and ``GymStepWriter.step``,
each timed against the stored dtypes on the same path, and against SB3 / TorchRL where
they have that path. Prints one JSON line (``--table``: the markdown table of a line).

Paths (``S`` envs, one step per env per call unless said):

* ``add``: ``ReplayBuffer.add(step)`` of 1 and of 8 envs; ``extend``: ``[8, 16]`` chunks;
* ``gym``: ``GymStepWriter.step(action, obs, reward, terminated, truncated, {})`` of 1 env.

Specs: ``vector`` (obs float32[4], int64 action, CartPole's), ``float`` (obs float32[17],
action float32[6], SAC on HalfCheetah's), ``pixel`` (gym only: uint8 (4, 84, 84)
frame-stacked obs, int64 action). Rewards float32.

Input kinds: ``typed`` (every value a C-contiguous numpy array of the stored dtype:
the reference of each path), ``readme`` (the README's ``np.full(S, StepType.MID)``
int64 step types), ``float64`` (obs, float actions and rewards as float64), ``int32``
(integer actions as int32), ``strided`` (obs a non-contiguous view), ``discount_bool``
(a bool discount), ``lists`` (Python lists), ``scalars`` (1 env: Python scalars for the
scalar fields), ``torch`` (CPU tensors), ``cuda`` (CUDA tensors, when a GPU is there).
The gym path's kinds: ``typed``, ``gymnasium`` (float64 rewards, as gymnasium's vector
envs return them), ``list_action``, ``torch`` (action and obs tensors), ``float64``.

Every value is made (and converted to its kind) before timing; the steps are MID steps
after one FIRST (the gym path ends episodes at random, 2% of steps). The kinds of one
path alternate in rounds (``--rounds`` x ``--calls`` calls each) on one buffer, so the
ratios compare calls made under the same load; each call is timed on its own
(``perf_counter_ns``): mean, median and worst per kind; and each round's CPU time per
call (``cpu_mean_us``: the median over rounds; ``ratio_cpu``), the figure a loaded
machine disturbs least. Peers: stable-baselines3's
``ReplayBuffer.add`` (``add`` and ``gym`` paths, ``n_envs=S``; pixel:
``optimize_memory_usage=True``), TorchRL's ``ReplayBuffer.extend`` of a TensorDict
(``extend``: 128 transitions), each with numpy inputs of its own native form, timed the
same way, alternated with ours.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common

SPECS = {"vector": ((4,), np.float32, (), np.int64), "float": ((17,), np.float32, (6,), np.float32),
         "pixel": ((4, 84, 84), np.uint8, (), np.int64)}
ADD_KINDS = ("typed", "readme", "float64", "int32", "strided", "discount_bool", "lists", "scalars",
             "torch", "cuda")
GYM_KINDS = ("typed", "gymnasium", "list_action", "torch", "float64")
POOL = 64


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _spec(name: str) -> Any:
    import shardreplay as sr

    obs_shape, obs_dtype, act_shape, act_dtype = SPECS[name]
    return sr.Spec({"obs": sr.Field(obs_shape, obs_dtype, frame_stack=name == "pixel"),
                    "action": sr.Field(act_shape, act_dtype), "reward": sr.Field((), np.float32)})


def _typed_steps(spec_name: str, lead: tuple[int, ...], rng: np.random.Generator) -> list[dict[str, Any]]:
    obs_shape, obs_dtype, act_shape, act_dtype = SPECS[spec_name]
    steps = []
    for _ in range(POOL):
        obs = (rng.integers(0, 255, (*lead, *obs_shape)) if obs_dtype == np.uint8 else
               rng.standard_normal((*lead, *obs_shape)))
        act = (rng.integers(0, 2, (*lead, *act_shape)) if act_dtype == np.int64 else
               rng.uniform(-1, 1, (*lead, *act_shape)))
        steps.append({"obs": obs.astype(obs_dtype), "action": act.astype(act_dtype),
                      "reward": rng.standard_normal(lead).astype(np.float32),
                      "step_type": np.ones(lead, np.uint8)})
    return steps


def _as_kind(step: dict[str, Any], kind: str, spec_name: str) -> dict[str, Any] | None:
    """``step`` (typed) as input kind ``kind``; None when the kind does not apply."""
    import torch

    from shardreplay import StepType

    lead = step["step_type"].shape
    if kind == "typed":
        return step
    if kind == "readme":
        return {**step, "step_type": np.full(lead, StepType.MID)}
    if kind == "float64":
        out = {**step, "reward": step["reward"].astype(np.float64)}
        for name in ("obs", "action"):
            if step[name].dtype.kind == "f":
                out[name] = step[name].astype(np.float64)
        return out
    if kind == "int32":
        action = step["action"]
        return {**step, "action": action.astype(np.int32)} if action.dtype.kind == "i" else None
    if kind == "strided":
        wide = np.repeat(step["obs"], 2, axis=-1)
        return {**step, "obs": wide[..., ::2]}
    if kind == "discount_bool":
        return {**step, "discount": np.ones(lead, bool)}
    if kind == "lists":
        return {k: v.tolist() for k, v in step.items()}
    if kind == "scalars":
        if lead != (1,):
            return None
        return {k: (v.reshape(v.shape[1:]).tolist() if v.ndim > 1 else v.item()) if k != "step_type"
                else StepType.MID for k, v in step.items()}
    if kind in ("torch", "cuda"):
        if kind == "cuda" and not _cuda():
            return None
        device = "cuda" if kind == "cuda" else "cpu"
        return {k: torch.from_numpy(v).to(device) for k, v in step.items()}
    raise ValueError(kind)


def _timed_calls(call: Callable[[int], Any], n: int, into: list[int]) -> float:
    """``n`` calls, each one's wall time appended to ``into`` (ns); returns the block's CPU
    time per call (us, this process's: steadier than wall on a loaded machine)."""
    clock = time.perf_counter_ns
    cpu = time.process_time()
    for i in range(n):
        t0 = clock()
        call(i)
        into.append(clock() - t0)
    return (time.process_time() - cpu) / n * 1e6


def _stats(ns: list[int], cpu: list[float]) -> dict[str, float]:
    us = np.asarray(ns, np.float64) / 1e3
    return {"mean_us": round(float(us.mean()), 3), "median_us": round(float(np.median(us)), 3),
            "worst_us": round(float(us.max()), 1), "calls": int(us.size),
            "cpu_mean_us": round(float(np.median(cpu)), 3)}


def _alternate(calls: dict[str, Callable[[int], Any]], rounds: int, n: int) -> dict[str, dict[str, float]]:
    """Each call ``n`` times per round, the kinds in turn, ``rounds`` rounds (GC off): per
    kind the wall time of each call, and the CPU time per call of each round (its median)."""
    times: dict[str, list[int]] = {k: [] for k in calls}
    cpu: dict[str, list[float]] = {k: [] for k in calls}
    for call in calls.values():  # warm-up, untimed
        for i in range(min(n, 200)):
            call(i)
    gc.disable()
    try:
        for _ in range(rounds):
            for kind, call in calls.items():
                cpu[kind].append(_timed_calls(call, n, times[kind]))
    finally:
        gc.enable()
    return {k: _stats(v, cpu[k]) for k, v in times.items()}


# ------------------------------------------------------------------------------------ ours

def _add_calls(spec_name: str, envs: int, t_len: int | None, capacity: int,
               rng: np.random.Generator) -> dict[str, Callable[[int], Any]]:
    import shardreplay as sr
    from shardreplay import testing

    lead = (envs,) if t_len is None else (envs, t_len)
    buf = sr.ReplayBuffer(_spec(spec_name), num_streams=envs, stream_capacity=max(capacity // envs, 64),
                          window=2, seed=0)
    typed = _typed_steps(spec_name, lead, rng)
    first = {**typed[0], "step_type": np.zeros(lead, np.uint8)}
    if t_len is None:
        testing.shard(buf).use_one_step()  # the short path, as after the first 1000 adds
        buf.add(first)
        write = buf.add
    else:
        first["step_type"][:, 1:] = 1
        buf.extend(first)
        write = buf.extend
    calls = {}
    for kind in ADD_KINDS:
        pool = [_as_kind(s, kind, spec_name) for s in typed]
        if pool[0] is None:
            continue
        calls[kind] = (lambda p: lambda i: write(p[i % POOL]))(pool)
    return calls


def _gym_calls(spec_name: str, capacity: int, rng: np.random.Generator) -> dict[str, Callable[[int], Any]]:
    import torch

    import shardreplay as sr

    buf = sr.ReplayBuffer(_spec(spec_name), num_streams=1, stream_capacity=capacity, window=2, seed=0)
    writer = sr.GymStepWriter(buf, autoreset_mode="next_step")
    typed = _typed_steps(spec_name, (1,), rng)
    ends = rng.random(POOL) < 0.02
    ends[-1] = True  # the pool's end ends an episode: cycling it starts the next one
    if spec_name == "pixel":  # a stack continues the previous one by one frame
        frames = rng.integers(0, 255, (POOL + 4, 84, 84), dtype=np.uint8)
        for i, s in enumerate(typed):
            s["obs"] = frames[None, i + 1:i + 5].copy()
        typed.insert(0, {"obs": frames[None, 0:4].copy()})
        reset_obs = typed.pop(0)["obs"]
    else:
        reset_obs = typed[-1]["obs"]
    writer.reset(reset_obs)
    rows = [(s["action"], s["obs"], s["reward"], ends[i:i + 1].copy(), np.zeros(1, bool))
            for i, s in enumerate(typed)]
    kinds: dict[str, list[tuple[Any, ...]]] = {
        "typed": rows,
        "gymnasium": [(a, o, r.astype(np.float64), te, tr) for a, o, r, te, tr in rows],
        "list_action": [(a.tolist(), o, r, te, tr) for a, o, r, te, tr in rows],
        "torch": [(torch.from_numpy(a), torch.from_numpy(o), r, te, tr) for a, o, r, te, tr in rows],
    }
    if SPECS[spec_name][1] == np.float32:
        kinds["float64"] = [(a, o.astype(np.float64), r, te, tr) for a, o, r, te, tr in rows]
    info: dict[str, Any] = {}
    count = [0]  # one step sequence over all kinds: the kinds alternate on one writer

    def make(pool: list[tuple[Any, ...]]) -> Callable[[int], Any]:
        def call(_i: int) -> None:
            k = count[0] % POOL
            count[0] += 1
            writer.step(*pool[k], info)
        return call
    return {kind: make(pool) for kind, pool in kinds.items()}


# ----------------------------------------------------------------------------------- peers

def _sb3_call(spec_name: str, envs: int, capacity: int,
             rng: np.random.Generator) -> Callable[[int], Any] | None:
    try:
        from gymnasium import spaces
        from stable_baselines3.common.buffers import ReplayBuffer
    except ImportError:
        return None
    obs_shape, obs_dtype, act_shape, act_dtype = SPECS[spec_name]
    obs_space = (spaces.Box(0, 255, obs_shape, np.uint8) if obs_dtype == np.uint8 else
                 spaces.Box(-np.inf, np.inf, obs_shape, np.float32))
    act_space = spaces.Discrete(2) if act_dtype == np.int64 else spaces.Box(-1, 1, act_shape, np.float32)
    pixel = spec_name == "pixel"
    buf = ReplayBuffer(max(capacity // envs, 64), obs_space, act_space, "cpu", n_envs=envs,
                       optimize_memory_usage=pixel, handle_timeout_termination=False)
    typed = _typed_steps(spec_name, (envs,), rng)
    dones = np.zeros(envs, np.float32)
    infos: list[dict[str, Any]] = [{} for _ in range(envs)]

    def call(i: int) -> None:
        s, nxt = typed[i % POOL], typed[(i + 1) % POOL]
        buf.add(s["obs"], nxt["obs"], s["action"], s["reward"], dones, infos)
    return call


def _torchrl_call(spec_name: str, envs: int, t_len: int, capacity: int,
                  rng: np.random.Generator) -> Callable[[int], Any] | None:
    try:
        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, ReplayBuffer
    except ImportError:
        return None
    buf = ReplayBuffer(storage=LazyTensorStorage(capacity))
    n = envs * t_len
    tds = []
    for s in _typed_steps(spec_name, (n,), rng)[:8]:
        obs = torch.from_numpy(s["obs"])
        tds.append(TensorDict({"observation": obs, "action": torch.from_numpy(s["action"]),
                               "next": {"observation": obs.clone(), "reward": torch.from_numpy(s["reward"]),
                                        "done": torch.zeros(n, dtype=torch.bool)}}, batch_size=[n]))
    return lambda i: buf.extend(tds[i % 8])


# ------------------------------------------------------------------------------------ main

def run(quick: bool, rounds: int, calls: int, capacity: int, seed: int,
        only: tuple[str, ...] = ("add", "extend", "gym")) -> dict[str, Any]:
    """The matrix's cases of the paths in ``only``; the JSON line's ``cases`` and ``peers``."""
    rng = np.random.default_rng(seed)
    paths: list[tuple[str, str, int, int | None]] = [
        ("add", "vector", 1, None), ("add", "vector", 8, None), ("add", "float", 1, None),
        ("add", "float", 8, None), ("extend", "vector", 8, 16), ("extend", "float", 8, 16),
        ("gym", "vector", 1, None), ("gym", "float", 1, None), ("gym", "pixel", 1, None)]
    paths = [p for p in paths if p[0] in only and (not quick or p[1] != "float" or p[0] == "gym")]
    cases, peers = [], []
    for path, spec_name, envs, t_len in paths:
        cap = min(capacity, 20_000) if spec_name == "pixel" else capacity
        if path == "gym":
            ours = _gym_calls(spec_name, cap, rng)
            peer = {"sb3": _sb3_call(spec_name, 1, cap, rng)}
        else:
            ours = _add_calls(spec_name, envs, t_len, cap, rng)
            peer = ({"torchrl": _torchrl_call(spec_name, envs, t_len, cap, rng)} if t_len else
                    {"sb3": _sb3_call(spec_name, envs, cap, rng)})
        timed = {**ours, **{f"peer:{k}": c for k, c in peer.items() if c is not None}}
        got = _alternate(timed, rounds, calls)
        typed = got["typed"]
        for kind in ours:
            row = {"path": path, "spec": spec_name, "envs": envs, "t_len": t_len, "kind": kind, **got[kind],
                   "ratio_median": round(got[kind]["median_us"] / typed["median_us"], 3),
                   "ratio_mean": round(got[kind]["mean_us"] / typed["mean_us"], 3),
                   "ratio_cpu": round(got[kind]["cpu_mean_us"] / typed["cpu_mean_us"], 3)}
            for name in peer:
                if f"peer:{name}" in got:
                    theirs = got[f"peer:{name}"]
                    row[f"vs_{name}_median"] = round(got[kind]["median_us"] / theirs["median_us"], 3)
                    row[f"vs_{name}_cpu"] = round(got[kind]["cpu_mean_us"] / theirs["cpu_mean_us"], 3)
            cases.append(row)
        for name in peer:
            if f"peer:{name}" in got:
                peers.append({"path": path, "spec": spec_name, "envs": envs, "t_len": t_len, "peer": name,
                              **got[f"peer:{name}"]})
    return {"cases": cases, "peers": peers}


def table(line: dict[str, Any]) -> str:
    """The markdown table of a JSON line: per path, each kind's median, mean and CPU ratio to
    the typed input, its median, and the README-style input against the peer."""
    kinds: list[str] = []
    for c in line["cases"]:
        if c["kind"] not in kinds:
            kinds.append(c["kind"])
    out = ["| path | spec | envs | typed median us | " + " | ".join(kinds) + " | peer median us |",
           "| --- | --- | --- | ---: | " + " | ".join("---:" for _ in kinds) + " | ---: |"]
    groups: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for c in line["cases"]:
        groups.setdefault((c["path"], c["spec"], c["envs"], c["t_len"]), {})[c["kind"]] = c
    for (path, spec, envs, t_len), row in groups.items():
        peer = [p for p in line["peers"]
                if (p["path"], p["spec"], p["envs"], p["t_len"]) == (path, spec, envs, t_len)]
        cells = [f"{row[k]['ratio_median']:.2f} / {row[k]['ratio_mean']:.2f} / {row[k]['ratio_cpu']:.2f}"
                 if k in row else "" for k in kinds]
        shape = f"{envs}x{t_len}" if t_len else str(envs)
        peer_cell = f"{peer[0]['peer']} {peer[0]['median_us']:.2f}" if peer else ""
        out.append(f"| {path} | {spec} | {shape} | {row['typed']['median_us']:.2f} | " + " | ".join(cells)
                   + f" | {peer_cell} |")
    return "\n".join(out)


def main() -> None:
    p = common.parser(__doc__, quick="a few calls of fewer paths: a smoke run (numbers mean nothing)")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds per path")
    p.add_argument("--calls", type=int, default=2_000, help="calls per kind per round")
    p.add_argument("--capacity", type=int, default=1_000_000, help="steps per buffer (pixel: at most 20,000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paths", default="add,extend,gym", help="comma-separated paths to time")
    p.add_argument("--table", type=Path, help="print the markdown table of this JSON line file and exit")
    args = p.parse_args()
    if args.table:
        import json

        print(table(json.loads(args.table.read_text().splitlines()[-1])))
        return
    if args.quick:
        args.rounds, args.calls, args.capacity = 2, 20, 2_000
    import shardreplay

    started = time.perf_counter()
    got = run(args.quick, args.rounds, args.calls, args.capacity, args.seed, tuple(args.paths.split(",")))
    line = {"bench": "inputs", "quick": bool(args.quick), "rounds": args.rounds, "calls": args.calls,
            "capacity": args.capacity, "shardreplay": shardreplay.__version__, "commit": common.commit(),
            "python": common.python(), "cpus": common.cpus(), "loadavg": common.loadavg(), **got,
            "seconds": round(time.perf_counter() - started, 1)}
    common.emit_line(line, args.out)


if __name__ == "__main__":
    main()
