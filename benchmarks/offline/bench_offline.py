"""Minari export and import throughput: ours against Minari's own writer, lossless.

For a vector spec (CartPole-like float32 ``[4]``) and an Atari-like pixel spec (uint8
``[4, 84, 84]`` frame stacks, stored by the buffer one frame per step) on 1 and 2
saved shards, the parent writes a checkpoint of whole episodes, then times in one
process (CPU seconds: the machine is shared):

* ``export``: ``shardreplay.offline.export_checkpoint`` (read the parts, reassemble the
  episodes, write), against ``minari.create_dataset_from_buffers`` writing the same
  episodes (already in memory: only its write is timed) with ``jpeg_encoding=False``;
  both in Minari's default ``hdf5`` and in ``arrow``; with 2 shards also ``jobs=2``
  (a process per shard: CPU time of this process and its children);
* ``import``: ``shardreplay.offline.prefill`` of the dataset into a fresh buffer,
  against Minari reading the same episodes (``iterate_episodes``) alone;
* ``versions``: what the per-step ``policy_version`` field of a training run's shards
  costs a CartPole-like prioritized buffer of 8 rows: the bytes a step of its arrays, an
  ``extend`` of a 400-step chunk and a ``sample(64)``, without and with the field
  (alternated, CPU time, medians).

Each case alternates ours and Minari's ``--rounds`` times (each round a fresh dataset)
and reports the medians. Rates are steps/s and MB/s of step data (observation, action,
reward: the bytes a user holds) per CPU-second, and per wall-second (``wall``: the
neighbours' load counts there). ``ratio`` is Minari's time over ours (>= 1: ours is as
fast); bytes per step compare the dataset with the buffer's storage (a frame stack
stored once per frame). One JSON line on stdout.

Usage::

    python benchmarks/offline/bench_offline.py            # 40k vector / 4k pixel steps (~10 min, 2 cores)
    python benchmarks/offline/bench_offline.py --quick    # smoke run
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common
import numpy as np

EP_LEN = 100


def _spec(kind: str) -> Any:
    import shardreplay as sr

    obs = sr.Field((4,), np.float32) if kind == "vector" else \
        sr.Field((4, 84, 84), np.uint8, frame_stack=True)
    return sr.Spec({"obs": obs, "action": sr.Field((), np.int64), "reward": sr.Field((), np.float32)})


def _checkpoint(root: Path, kind: str, steps: int, shards: int) -> list[Any]:
    """Save ``shards`` parts of whole episodes (2 streams each); return them as Minari
    episode buffers (what create_dataset_from_buffers is given)."""
    from minari.data_collector import EpisodeBuffer

    import shardreplay as sr
    from shardreplay import checkpoint
    from shardreplay.distributed import ShardedReplayBuffer

    rng = np.random.default_rng(0)
    per_row = steps // (2 * shards) // EP_LEN * EP_LEN
    episodes = []
    for k in range(shards):
        buf = sr.ReplayBuffer(_spec(kind), num_streams=2, stream_capacity=per_row, sampler="prioritized")
        for _e in range(per_row // EP_LEN):
            if kind == "vector":
                obs = rng.random((2, EP_LEN, 4), np.float32)
            else:
                frames = rng.integers(0, 256, (2, EP_LEN + 3, 84, 84), np.uint8)
                frames[:, :3] = frames[:, 3:4]  # the reset frame repeated, as gymnasium's stack pads
                obs = np.stack([frames[:, i:i + EP_LEN] for i in range(4)], axis=2)
            action = rng.integers(0, 4, (2, EP_LEN))
            reward = rng.random((2, EP_LEN)).astype(np.float32)
            action[:, -1], reward[:, -1] = 0, 0
            types = np.full((2, EP_LEN), 1, np.uint8)
            types[:, 0], types[:, -1] = 0, 2
            buf.extend({"obs": obs, "action": action, "reward": reward, "step_type": types,
                        "discount": np.where(types == 2, 0, 1).astype(np.float32)})
            for r in range(2):
                done = np.zeros(EP_LEN - 1, bool)
                done[-1] = True
                episodes.append(EpisodeBuffer(observations=obs[r], actions=action[r, :-1],
                                              rewards=reward[r, :-1], terminations=done,
                                              truncations=np.zeros(EP_LEN - 1, bool)))
        stub = object.__new__(ShardedReplayBuffer)  # a rank's part without a process group
        stub.local, stub.rank, stub.world_size = buf, k, shards
        from shardreplay.distributed.runner import InlineRunner
        from shardreplay.distributed.sharded_buffer import ShardedInternals
        rng = np.random.default_rng(k)
        stub._internals = ShardedInternals(None, None, None, rng, InlineRunner(None, None), None)
        checkpoint.save(stub, root, 1)
    return episodes


def _cpu() -> float:
    """CPU seconds of this process and of its children that have ended."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _timed(fn: Any) -> tuple[float, float]:
    """(CPU s with children, wall s) of ``fn()``."""
    cpu, wall = _cpu(), time.perf_counter()
    fn()
    return _cpu() - cpu, time.perf_counter() - wall


def _case(tmp: Path, kind: str, steps: int, shards: int, fmt: str, rounds: int) -> dict[str, Any]:
    import gymnasium as gym
    import minari

    import shardreplay as sr
    from shardreplay.offline import export_checkpoint, prefill

    os.environ["MINARI_DATASETS_PATH"] = str(tmp / "datasets")
    root = tmp / f"ck-{kind}-{shards}"
    if not root.exists():
        _checkpoint(root, kind, steps, shards)
    eps = _checkpoint(tmp / "scratch", kind, steps, shards)  # the same episodes, in memory
    shutil.rmtree(tmp / "scratch")
    obs_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32) if kind == "vector" else \
        gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    spaces = {"observation_space": obs_space, "action_space": gym.spaces.Discrete(4)}
    about = dict.fromkeys(["algorithm_name", "author", "author_email", "code_permalink", "description"],
                          "bench")
    times: dict[str, list[tuple[float, float]]] = {"ours": [], "jobs": [], "theirs": []}
    summary: dict[str, Any] = {}
    for r in range(rounds):
        name = f"{kind}-{shards}-{fmt}-{r}-v0"
        ours_id, theirs_id = f"sr/ours-{name}", f"sr/theirs-{name}"

        def ours(dataset_id: str = ours_id, jobs: int = 1) -> None:
            summary.update(export_checkpoint(root, dataset_id, **spaces, data_format=fmt, jobs=jobs))

        def theirs(dataset_id: str = theirs_id) -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                minari.create_dataset_from_buffers(dataset_id, eps, **spaces, **about, data_format=fmt,
                                                   jpeg_encoding=False)

        times["ours"].append(_timed(ours))
        times["theirs"].append(_timed(theirs))
        if shards > 1:
            times["jobs"].append(_timed(lambda name=name: ours(f"sr/jobs-{name}", shards)))
    med = {k: (statistics.median(c for c, _w in v), statistics.median(w for _c, w in v))
           for k, v in times.items() if v}
    n = summary["steps"] + summary["episodes"]  # stored steps (N + 1 observations)
    step_bytes = int(np.prod(obs_space.shape)) * obs_space.dtype.itemsize + 8 + 4
    mb = n * step_bytes / 1e6
    buf = sr.ReplayBuffer(_spec(kind), num_streams=2 * shards, stream_capacity=n // (2 * shards) + EP_LEN,
                          sampler="prioritized")
    with common.timed() as imp:
        prefill(buf, ours_id)
    with common.timed() as read:
        for _ep in minari.load_dataset(theirs_id).iterate_episodes():
            pass
    buffer_bytes = (84 * 84 if kind == "pixel" else 16) + 8 + 4
    (cpu, wall), (their_cpu, their_wall) = med["ours"], med["theirs"]
    out = {"kind": kind, "shards": shards, "format": fmt, "steps": n, "rounds": rounds,
           "export_steps_per_s": round(n / cpu), "export_mb_per_s": round(mb / cpu, 1),
           "export_wall_steps_per_s": round(n / wall),
           "minari_write_steps_per_s": round(n / their_cpu),
           "minari_write_wall_steps_per_s": round(n / their_wall),
           "export_ratio": round(their_cpu / cpu, 2), "export_wall_ratio": round(their_wall / wall, 2),
           "import_steps_per_s": round(n / imp.cpu_s), "import_mb_per_s": round(mb / imp.cpu_s, 1),
           "minari_read_steps_per_s": round(n / read.cpu_s),
           "import_vs_read_ratio": round(read.cpu_s / imp.cpu_s, 2),
           "dataset_bytes_per_step": round(summary["bytes"] / n, 1), "buffer_bytes_per_step": buffer_bytes}
    if "jobs" in med:
        jobs_cpu, jobs_wall = med["jobs"]
        out.update(jobs_export_steps_per_s=round(n / jobs_cpu),
                   jobs_export_wall_steps_per_s=round(n / jobs_wall),
                   jobs_export_ratio=round(their_cpu / jobs_cpu, 2),
                   jobs_export_wall_ratio=round(their_wall / jobs_wall, 2))
    return out


def _array_bytes(obj: Any, seen: set[int], depth: int = 0) -> int:
    """Bytes of the numpy arrays reachable from ``obj`` (attributes, dicts, lists and
    tuples, 6 levels deep; each array's base once)."""
    while isinstance(obj, np.ndarray) and isinstance(obj.base, np.ndarray):
        obj = obj.base
    if id(obj) in seen or depth > 6:
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else \
        vars(obj).values() if hasattr(obj, "__dict__") else ()
    return sum(_array_bytes(v, seen, depth + 1) for v in values)


def _versions(steps: int, rounds: int) -> dict[str, Any]:
    """The ``versions`` figures (module doc) for buffers of ``steps`` steps."""
    import shardreplay as sr
    from shardreplay.runtime.learner.loop import versioned
    from shardreplay.spec.fields import VERSION_FIELD as VERSION

    types = np.ones((8, 50), np.uint8)
    types[:, 0] = 0
    chunk = {"obs": np.random.default_rng(0).random((8, 50, 4), np.float32), "step_type": types,
             "action": np.zeros((8, 50), np.int64), "reward": np.ones((8, 50), np.float32)}
    bufs = {}
    for name, spec in (("plain", _spec("vector")), ("versioned", versioned(_spec("vector")))):
        data = {**chunk, VERSION: np.full((8, 50), 5, np.int64)} if VERSION in spec else chunk
        buf = sr.ReplayBuffer(spec, num_streams=8, stream_capacity=steps // 8, sampler="prioritized")
        bufs[name] = (buf, data)
        for _ in range(steps // 400):
            bufs[name][0].extend(data)
    times: dict[str, dict[str, list[float]]] = {name: {"extend_us": [], "sample64_us": []} for name in bufs}
    for _ in range(rounds):
        for name, (buf, data) in bufs.items():
            with common.timed() as ext:
                for _ in range(300):
                    buf.extend(data)
            with common.timed() as smp:
                for _ in range(1000):
                    buf.sample(64)
            times[name]["extend_us"].append(ext.cpu_s / 300 * 1e6)
            times[name]["sample64_us"].append(smp.cpu_s / 1000 * 1e6)
    return {name: {"bytes_per_step": round(_array_bytes(buf, set()) / steps, 1),
                   **{k: round(statistics.median(v), 1) for k, v in times[name].items()}}
            for name, (buf, _data) in bufs.items()}


def main() -> None:
    """Run every case; print the JSON line."""
    parser = common.parser(__doc__, quick="a small smoke run")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds per case (medians)")
    args = parser.parse_args()
    vector, pixel = (1_000, 400) if args.quick else (40_000, 4_000)  # >= one episode a row
    cases = []
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("hdf5", "arrow"):
            _case(Path(tmp) / "warmup", "vector", 400, 2, fmt, 1)  # imports and compiled kernels: not timed
        for kind, steps in (("vector", vector), ("pixel", pixel)):
            for shards in (1, 2):
                for fmt in ("hdf5", "arrow"):
                    cases.append(_case(Path(tmp), kind, steps, shards, fmt, 1 if args.quick else args.rounds))
    versions = _versions(4_000 if args.quick else 400_000, 1 if args.quick else 7)
    common.emit_line({"bench": "offline", "cases": cases, "versions": versions,
                      "wall_s": round(time.time() - started, 1), "loadavg": common.loadavg(),
                      "cpus": common.cpus(), "commit": common.commit(), "when": common.now()}, args.out)


if __name__ == "__main__":
    main()
