"""The Nature-DQN workload of the replay benchmark (``bench_replay.py --workload atari``).

* A step's observation is a stack of 4 frames of 84x84 uint8 (28,224 bytes), as the
  Nature-DQN conv net takes it; action int64, reward float32.
* 32 environments step together (inserts of 32 steps). Each step shifts one new random
  frame into its environment's stack; an episode's first stack repeats its first frame
  (gymnasium's ``FrameStackObservation``). A pool of 128 steps per environment is made
  once; episodes end at random (probability 1/64 a step) and at the pool's end, so the
  pool is cycled with every stack consistent.
* Prioritized replay (alpha 0.6, beta 0.4); a learner step samples 256 transitions and
  updates their 256 priorities (issue 13: batch 256 for the conv net).

Cases, each in its own child process:

* ``shardreplay``: ``Field((4, 84, 84), np.uint8, frame_stack=True)``, windows of 2 steps
  (a transition): each frame is stored once per stream.
* ``cpprb_stack``: cpprb ``PrioritizedReplayBuffer(next_of="obs", stack_compress="obs")``,
  obs ``(84, 84, 4)`` (cpprb wants the stack axis last): one frame per transition. Its
  sharing assumes consecutive adds are consecutive steps of one environment; with 32
  environments per add its stored stacks are mixed (0 of 256 sampled stacks were right in
  a check), so it is timed and measured here, not a correct alternative for vector envs.
* ``cpprb_plain``: cpprb with ``obs`` and ``next_obs`` as own fields, as the reference
  workload stores them for the peers (``replay_workload.py``): the memory reference.

Memory: 1M transitions of these frames do not fit this machine (cpprb's plain storage needs
52.6 GiB), so each case is filled at a reduced capacity (``--atari-capacity``, default
65,536; cpprb plain at 16,384), its RSS measured, and its bytes at 1,000,000 computed from
its layout: shardreplay's arrays as allocated for 1M (memory-mapped, never touched), cpprb's
from its field sizes. The reduced runs check the layout figures against RSS.
"""

from __future__ import annotations

import gc
import importlib.metadata as im
import tempfile
import time
from typing import Any

import numpy as np
import replay_workload as W

STACK = 4
FRAME = (84, 84)
STREAMS = 32
POOL_CALLS = 128
DONE_PROBABILITY = 1 / 64
NOMINAL = 1_000_000
CAPACITY = 65_536
PLAIN_CAPACITY = 16_384
WARMUP_CAPACITY = 3_200
SAMPLE_BATCH = 256
CASE_NAMES = ("shardreplay", "cpprb_stack", "cpprb_plain")
OBS_BYTES = STACK * FRAME[0] * FRAME[1]


def make_frame_pool(seed: int) -> dict[str, np.ndarray]:
    """``POOL_CALLS`` steps of ``STREAMS`` environments: ``obs`` uint8 ``[calls, S, 4, 84, 84]``,
    ``action``, ``reward``, ``step_type`` ``[calls, S]``. Call 0 is every stream's FIRST
    step and the last call ends every episode, so the pool can be cycled."""
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 256, (POOL_CALLS, STREAMS, *FRAME), dtype=np.uint8)
    done = rng.random((POOL_CALLS, STREAMS)) < DONE_PROBABILITY
    done[-1] = True
    types = np.empty((POOL_CALLS, STREAMS), np.uint8)
    obs = np.empty((POOL_CALLS, STREAMS, STACK, *FRAME), np.uint8)
    prev_last = np.ones(STREAMS, bool)
    for c in range(POOL_CALLS):
        types[c] = np.where(prev_last, W.FIRST, np.where(done[c], W.LAST, W.MID))
        first = types[c] == W.FIRST
        obs[c, first] = frames[c, first][:, None]  # a reset stack repeats the first frame
        if c:
            obs[c, ~first, :-1] = obs[c - 1, ~first, 1:]
            obs[c, ~first, -1] = frames[c, ~first]
        prev_last = types[c] == W.LAST
    return {"obs": obs, "action": rng.integers(0, W.NUM_ACTIONS, (POOL_CALLS, STREAMS), dtype=np.int64),
            "reward": rng.standard_normal((POOL_CALLS, STREAMS), dtype=np.float32), "step_type": types}


class ShardReplayFrames:
    """shardreplay with a frame-stacked observation, 32 streams, windows of 2 steps."""

    name = "shardreplay"

    def __init__(self, pool: dict[str, np.ndarray]) -> None:
        import torch

        import shardreplay as sr

        self._sr, self._torch = sr, torch
        self._spec = sr.Spec({"obs": sr.Field((STACK, *FRAME), np.uint8, frame_stack=True),
                              "action": sr.Field((), np.int64), "reward": sr.Field((), np.float32)})
        discount = np.where(pool["step_type"] == W.LAST, 0.0, 1.0).astype(np.float32)
        self._steps = [{"obs": pool["obs"][c], "action": pool["action"][c], "reward": pool["reward"][c],
                        "step_type": pool["step_type"][c], "discount": discount[c]}
                       for c in range(POOL_CALLS)]
        self._prios = [torch.from_numpy(p) for p in W.random_priorities()]
        self.buf: Any = None

    def versions(self) -> dict[str, Any]:
        """Library version."""
        return {"version": im.version("shardreplay")}

    def _make(self, capacity: int, **storage: Any) -> Any:
        return self._sr.ReplayBuffer(self._spec, num_streams=STREAMS, stream_capacity=capacity // STREAMS,
                                     window=2, sampler="prioritized", alpha=W.ALPHA, beta=W.BETA, seed=0,
                                     **storage)

    def create(self, capacity: int) -> None:
        """A buffer of ``capacity`` steps."""
        self.buf = self._make(capacity)

    def add(self, i: int) -> None:
        """One step of each of the 32 streams."""
        self.buf.add(self._steps[i % POOL_CALLS])

    def sample(self) -> Any:
        """256 windows of 2 steps with weights."""
        return self.buf.sample(SAMPLE_BATCH)

    def learner_step(self, i: int) -> None:
        """Sample 256, update their priorities."""
        batch = self.buf.sample(SAMPLE_BATCH)
        self.buf.update_priorities(batch.keys, self._prios[i % len(self._prios)])

    def layout_bytes(self, capacity: int) -> int:
        """Bytes of every array of a buffer of ``capacity`` steps, allocated as memory-mapped
        files that are never touched (so 1M steps need no RAM)."""
        with tempfile.TemporaryDirectory() as directory:
            buf = self._make(capacity, storage="memmap", directory=directory)
            total = _array_bytes(buf)
            del buf
            gc.collect()
        return total

    def extras(self) -> dict[str, Any]:
        """The filled buffer's frame rings: their size now, and its arrays' bytes."""
        from shardreplay import testing  # here: bench_replay's parent process imports no torch

        store = testing.shard(self.buf)._storage.stacked["obs"]
        return {"frame_capacity": store.frame_capacity,
                "filled_layout_bytes": _array_bytes(self.buf)}


def _array_bytes(buf: Any) -> int:
    """Bytes of a shardreplay buffer's arrays: per-slot records, fields that own their
    arrays (small fields are views of the records), frame rings, sum and min trees."""
    from shardreplay import testing

    storage = testing.shard(buf)._storage
    arrays = [storage.records, storage.pos, *testing.tree_sums(buf)]
    arrays += [a for name, a in storage.fields.items() if name not in storage._small]
    for store in storage.stacked.values():
        arrays += [store.frames, store.ref, store.fpos]
    return sum(int(a.nbytes) for a in arrays)


class CpprbFrames:
    """cpprb PrioritizedReplayBuffer, with stack compression or plain obs + next_obs."""

    def __init__(self, pool: dict[str, np.ndarray], compress: bool) -> None:
        import cpprb

        self._cpprb, self.compress = cpprb, compress
        self.name = "cpprb_stack" if compress else "cpprb_plain"
        obs = np.ascontiguousarray(pool["obs"].transpose(0, 1, 3, 4, 2))  # cpprb: stack axis last
        nxt = np.roll(np.arange(POOL_CALLS), -1)
        self._adds = [{"obs": obs[c], "next_obs": obs[nxt[c]], "act": pool["action"][c],
                       "rew": pool["reward"][c], "done": pool["step_type"][nxt[c]] == W.LAST}
                      for c in range(POOL_CALLS)]
        self._prios = W.random_priorities()
        np.random.seed(0)
        self.buf: Any = None

    def versions(self) -> dict[str, Any]:
        """Library version."""
        return {"version": im.version("cpprb")}

    def env_dict(self) -> dict[str, Any]:
        """cpprb's field layout."""
        env = {"obs": {"shape": (*FRAME, STACK), "dtype": np.uint8}, "act": {"dtype": np.int64},
               "rew": {"dtype": np.float32}, "done": {"dtype": np.bool_}}
        if not self.compress:
            env["next_obs"] = env["obs"]
        return env

    def create(self, capacity: int) -> None:
        """A buffer of ``capacity`` transitions (cpprb touches it all at creation)."""
        extra = {"next_of": "obs", "stack_compress": "obs"} if self.compress else {}
        self.buf = self._cpprb.PrioritizedReplayBuffer(capacity, self.env_dict(), alpha=W.ALPHA, **extra)

    def add(self, i: int) -> None:
        """32 transitions."""
        self.buf.add(**self._adds[i % POOL_CALLS])

    def sample(self) -> Any:
        """256 transitions with weights."""
        return self.buf.sample(SAMPLE_BATCH, beta=W.BETA)

    def learner_step(self, i: int) -> None:
        """Sample 256, update their priorities."""
        s = self.buf.sample(SAMPLE_BATCH, beta=W.BETA)
        self.buf.update_priorities(s["indexes"], self._prios[i % len(self._prios)])

    def layout_bytes(self, capacity: int) -> int:
        """Field bytes per transition times ``capacity`` (cpprb's numpy arrays), plus its
        two priority trees (float32 sum and min trees over the next power of two)."""
        per = sum(int(np.prod(f.get("shape", 1))) * np.dtype(f["dtype"]).itemsize
                  for f in self.env_dict().values())
        if self.compress:  # one frame per transition (plus the stack's other frames, once)
            per += FRAME[0] * FRAME[1] - OBS_BYTES
        tree = 2 * 2 * 4 * (1 << (capacity - 1).bit_length())
        return per * capacity + tree

    def extras(self) -> dict[str, Any]:
        """Nothing beyond the common figures."""
        return {}


def make_case(name: str, pool: dict[str, np.ndarray]) -> Any:
    """The case object of ``name``."""
    if name == "shardreplay":
        return ShardReplayFrames(pool)
    return CpprbFrames(pool, compress=name == "cpprb_stack")


def run_frames_case(name: str, args: Any) -> dict[str, Any]:
    """Fill one case at its measured capacity, time it, and give its memory figures."""
    pool = make_frame_pool(args.seed)
    case = make_case(name, pool)
    capacity = min(PLAIN_CAPACITY, args.atari_capacity) if name == "cpprb_plain" else args.atari_capacity
    out: dict[str, Any] = {**case.versions(), "capacity": capacity}
    start = time.perf_counter()
    case.create(WARMUP_CAPACITY)  # compiled code and first calls: not timed, not buffer memory
    for i in range(WARMUP_CAPACITY // STREAMS):
        case.add(i)
    case.learner_step(0)
    case.buf = None
    gc.collect()
    out["warmup_seconds"] = round(time.perf_counter() - start, 3)
    out["rss_mib_baseline"] = W.rss_mib()
    case.create(capacity)
    out.update(W.time_inserts(case.add, capacity // STREAMS))
    out["rss_mib_after_fill"] = W.rss_mib()
    out["rss_mib_buffer"] = round(out["rss_mib_after_fill"] - out["rss_mib_baseline"], 1)
    out["rss_bytes_per_transition"] = round(out["rss_mib_buffer"] * 2**20 / capacity, 1)
    timing = {"calls": args.calls, "blocks": args.blocks, "warmup": args.warmup}
    W.put_rate(out, "sample_batches_per_s", W.time_calls(lambda i: case.sample(), **timing))
    W.put_rate(out, "learner_steps_per_s", W.time_calls(case.learner_step, **timing))
    out["layout_bytes"] = case.layout_bytes(capacity)
    out["layout_bytes_per_transition"] = round(out["layout_bytes"] / capacity, 1)
    out["layout_bytes_1m"] = case.layout_bytes(NOMINAL)
    out["layout_gib_1m"] = round(out["layout_bytes_1m"] / 2**30, 2)
    out.update(case.extras())
    out["rss_mib_peak"] = W.peak_rss_mib()
    return out


def frames_ratios(results: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """shardreplay's figures over cpprb's, with the issue's targets."""
    ours = results.get("shardreplay", {})
    spec = (("memory_1m_vs_cpprb_plain", "layout_bytes_1m", "cpprb_plain", 0.3, False),
            ("memory_1m_vs_cpprb_stack", "layout_bytes_1m", "cpprb_stack", None, False),
            ("rss_per_transition_vs_cpprb_plain", "rss_bytes_per_transition", "cpprb_plain", 0.3, False),
            ("learner_step_vs_cpprb_stack", "learner_steps_per_s", "cpprb_stack", 1.0, True),
            ("sample_vs_cpprb_stack", "sample_batches_per_s", "cpprb_stack", None, True),
            ("insert_vs_cpprb_stack", "insert_tps", "cpprb_stack", None, True))
    values: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    for name, figure, peer, target, higher in spec:
        a, b = ours.get(figure), results.get(peer, {}).get(figure)
        values[name] = round(a / b, 3) if a and b else None
        if target is not None:
            got = values[name]
            met = None if got is None else (got >= target if higher else got <= target)
            targets[name] = {"target": (">= " if higher else "<= ") + str(target), "met": met}
    return values, targets


def interleaved_learner_steps(args: Any) -> dict[str, Any]:
    """shardreplay and cpprb_stack in one process, filled alike, their learner steps timed
    in alternating blocks: on a shared machine both see the same load, block by block.

    Returns the rates per block of each and the median of the per-pair ratios."""
    pool = make_frame_pool(args.seed)
    cases = [make_case(name, pool) for name in ("shardreplay", "cpprb_stack")]
    for case in cases:
        case.create(args.atari_capacity)
        for i in range(args.atari_capacity // STREAMS):
            case.add(i)
        for i in range(args.warmup):
            case.learner_step(i)
    rates: dict[str, list[float]] = {case.name: [] for case in cases}
    for block in range(args.blocks):
        for case in cases if block % 2 == 0 else cases[::-1]:
            rate, _low, _high = W.time_calls(case.learner_step, calls=args.calls, blocks=1, warmup=0)
            rates[case.name].append(round(rate, 1))
    ratio = [a / b for a, b in zip(rates["shardreplay"], rates["cpprb_stack"], strict=True)]
    return {"capacity": args.atari_capacity, "learner_steps_per_s_blocks": rates,
            "learner_step_ratio_blocks": [round(r, 3) for r in ratio],
            "learner_step_vs_cpprb_stack_median": round(float(np.median(ratio)), 3)}
