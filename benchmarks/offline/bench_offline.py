"""Minari export and import throughput: ours against Minari's own writer, lossless.

For a vector spec (CartPole-like float32 ``[4]``) and an Atari-like pixel spec (uint8
``[4, 84, 84]`` frame stacks, stored by the buffer one frame per step) on 1 and 2
saved shards, the parent writes a checkpoint of whole episodes, then times in one
process (CPU seconds: the machine is shared):

* ``export``: ``shardreplay.offline.export_checkpoint`` (read the parts, reassemble the
  episodes, write), against ``minari.create_dataset_from_buffers`` writing the same
  episodes (already in memory: only its write is timed) with ``jpeg_encoding=False``;
  both in Minari's default ``hdf5`` and in ``arrow``;
* ``import``: ``shardreplay.offline.prefill`` of the dataset into a fresh buffer,
  against Minari reading the same episodes (``iterate_episodes``) alone.

Rates are steps/s and MB/s of step data (observation, action, reward: the bytes a user
holds). ``ratio`` is Minari's CPU time over ours (>= 1: ours is as fast); bytes per step
compare the dataset with the buffer's storage (a frame stack stored once per frame).
One JSON line on stdout.

Usage::

    python benchmarks/offline/bench_offline.py            # 40k vector / 4k pixel steps (~10 min, 2 cores)
    python benchmarks/offline/bench_offline.py --quick    # smoke run
"""

from __future__ import annotations

import os
import shutil
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
        from shardreplay.distributed.exchange import ShardChoice
        from shardreplay.distributed.internals import ShardedInternals
        from shardreplay.distributed.runner import InlineRunner
        stub._internals = ShardedInternals(None, None, None, ShardChoice(np.random.default_rng(k)),
                                           InlineRunner(None, None), None)
        checkpoint.save(stub, root, 1)
    return episodes


def _case(tmp: Path, kind: str, steps: int, shards: int, fmt: str) -> dict[str, Any]:
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
    ours_id, theirs_id = f"sr/ours-{kind}-{shards}-{fmt}-v0", f"sr/theirs-{kind}-{shards}-{fmt}-v0"
    with common.timed() as ours:
        summary = export_checkpoint(root, ours_id, **spaces, data_format=fmt)
    with common.timed() as theirs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        minari.create_dataset_from_buffers(theirs_id, eps, **spaces, data_format=fmt, jpeg_encoding=False,
                                           algorithm_name="bench", author="bench", author_email="bench",
                                           code_permalink="bench", description="bench")
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
    return {"kind": kind, "shards": shards, "format": fmt, "steps": n,
            "export_steps_per_s": round(n / ours.cpu_s), "export_mb_per_s": round(mb / ours.cpu_s, 1),
            "minari_write_steps_per_s": round(n / theirs.cpu_s),
            "export_ratio": round(theirs.cpu_s / ours.cpu_s, 2),
            "import_steps_per_s": round(n / imp.cpu_s), "import_mb_per_s": round(mb / imp.cpu_s, 1),
            "minari_read_steps_per_s": round(n / read.cpu_s),
            "import_vs_read_ratio": round(read.cpu_s / imp.cpu_s, 2),
            "dataset_bytes_per_step": round(summary["bytes"] / n, 1), "buffer_bytes_per_step": buffer_bytes}


def main() -> None:
    """Run every case; print the JSON line."""
    args = common.parser(__doc__, quick="a small smoke run").parse_args()
    vector, pixel = (1_000, 400) if args.quick else (40_000, 4_000)  # >= one episode a row
    cases = []
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        _case(Path(tmp) / "warmup", "vector", 400, 1, "hdf5")  # imports and compiled kernels: not timed
        for kind, steps in (("vector", vector), ("pixel", pixel)):
            for shards in (1, 2):
                for fmt in ("hdf5", "arrow"):
                    cases.append(_case(Path(tmp), kind, steps, shards, fmt))
    common.emit_line({"bench": "offline", "cases": cases, "wall_s": round(time.time() - started, 1),
                      "loadavg": common.loadavg(), "cpus": common.cpus(), "commit": common.commit(),
                      "when": common.now()}, args.out)


if __name__ == "__main__":
    main()
