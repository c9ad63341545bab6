"""The single-process buffer at every fill and every field kind, side by side with SB3.

One process holds both libraries' buffers and times their calls in alternating blocks
(shardreplay, SB3, shardreplay, ...), so load from other work on a shared machine hits
both alike; each figure is the median per-call time over the blocks, and the ratio is
shardreplay's median over SB3's (a time ratio: <= 1.0 is as fast as SB3 or faster).

* ``fill``: uniform ``sample(256)`` and ``sample_transitions(256)`` against SB3's
  ``sample(256)`` at 1%, 10%, 50% and 100% of 1M and 3M steps, 1 and 8 streams
  (CartPole-shaped steps: obs float32[4], an int64 action). Both buffers are filled
  directly (the fill is not timed; SB3's arrays are written as its ``add`` would).
* ``add``: one step per call for three field kinds: ``vector`` (CartPole, a discrete
  action), ``float`` (SAC's Pendulum: obs float32[3], action float32[1]) and ``pixel``
  (Breakout: ``Field((4, 84, 84), np.uint8, frame_stack=True)``, SB3 storing the stacks
  of obs and next obs). shardreplay through ``GymStepWriter.step`` (the documented path)
  and ``ReplayBuffer.add``; and each kind's samples (256 steps of vectors, 32 of pixels).
  Pixels also against a **warm** SB3 buffer (``add_writer_warm``, ``add_add_warm``): in
  the rows above SB3 fills a fresh 100k-step buffer, first-touching two 28 KiB stacks
  per step; a long run has every page touched. Both libraries' buffers of
  ``WARM_PIXEL_CAPACITY`` steps are filled past a wrap before the timed blocks.
* ``build``: seconds to construct a 1M-step pixel buffer.

Only what the sweep measures is imported at module level (numpy); the libraries are
imported by :func:`run`.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

FILLS = (0.01, 0.1, 0.5, 1.0)
CAPACITIES = (1_000_000, 3_000_000)
STREAMS = (1, 8)
SAMPLE_BATCH = 256
PIXEL_BATCH = 32
PIXEL_CAPACITY = 100_000  # SB3 reserves (never touches) 2 stacks per step: 5.6 GB
BUILD_CAPACITY = 1_000_000
PIXEL_FILL = 10_000
WARM_PIXEL_CAPACITY = 3_000  # steps; filled past a wrap (every page touched) before timing
POOL = 4_000  # a whole number of episodes: the pool cycles at an episode end
EPISODE = 50  # steps per episode in the pools
ONE_STEP_WARMUP = 1_100  # > the adds after which a buffer builds its one-step path (shard.py)
QUICK = {"fills": (0.01, 1.0), "capacities": (200_000,), "streams": (1, 8), "pixel_fill": 2_000,
         "blocks": 3, "calls": 50}
FULL = {"fills": FILLS, "capacities": CAPACITIES, "streams": STREAMS, "pixel_fill": PIXEL_FILL,
        "blocks": 7, "calls": 200}


# The clock of the timed blocks: wall time, or this thread's CPU time (``--clock cpu``),
# which leaves out the time other processes hold the core on an overloaded machine.
_CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}
_clock = time.perf_counter


def interleaved(ours: Callable[[], Any], theirs: Callable[[], Any], *, blocks: int, calls: int,
                warmup: int = 20) -> dict[str, float]:
    """Median microseconds per call of ``ours`` and ``theirs``, timed in alternating
    blocks of ``calls`` calls, their ratio, and the range of the per-block ratios."""
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    for f in (ours, theirs):  # warm-up
        for _ in range(min(calls, warmup) if warmup <= 20 else warmup):
            f()
    for _ in range(blocks):
        for name, f in (("ours", ours), ("theirs", theirs)):
            start = _clock()
            for _ in range(calls):
                f()
            times[name].append((_clock() - start) / calls * 1e6)
    a, b = statistics.median(times["ours"]), statistics.median(times["theirs"])
    # Each block's ratio to the SB3 block beside it: "every round <= 1.0" reads its max.
    per_block = [x / y for x, y in zip(times["ours"], times["theirs"], strict=True)]
    return {"shardreplay_us": round(a, 2), "sb3_us": round(b, 2), "ratio": round(a / b, 3),
            "ratio_min": round(min(per_block), 3), "ratio_max": round(max(per_block), 3)}


def _episode_types(n: int, streams: int) -> np.ndarray:
    """Step types ``[streams, n]``: episodes of ``EPISODE`` steps (FIRST ... LAST)."""
    t = np.arange(n) % EPISODE
    types = np.where(t == 0, 0, np.where(t == EPISODE - 1, 2, 1)).astype(np.uint8)
    return np.broadcast_to(types, (streams, n))


def _fill(sr: Any, sb3_cls: Any, spaces: Any, capacity: int, streams: int, steps: int) -> tuple[Any, Any]:
    """A shardreplay buffer and an SB3 buffer, each holding ``steps`` CartPole steps per
    stream (written in chunks; SB3's arrays written directly, as its ``add`` would)."""
    spec = sr.Spec({"obs": sr.Field((4,), np.float32), "action": sr.Field((), np.int64),
                    "reward": sr.Field((), np.float32)})
    ours = sr.ReplayBuffer(spec, num_streams=streams, stream_capacity=capacity // streams, seed=0)
    rng = np.random.default_rng(0)
    done = 0
    while done < steps:
        t_len = min(20_000, steps - done)
        types = _episode_types(done + t_len, streams)[:, done:]
        ours.extend({"obs": rng.standard_normal((streams, t_len, 4), dtype=np.float32),
                     "action": rng.integers(0, 2, (streams, t_len)),
                     "reward": np.ones((streams, t_len), np.float32), "step_type": np.array(types)})
        done += t_len
    # SB3 divides its buffer_size among the envs: capacity // streams steps per env.
    theirs = sb3_cls(capacity, spaces.Box(-np.inf, np.inf, (4,), np.float32), spaces.Discrete(2),
                     "cpu", n_envs=streams, handle_timeout_termination=False)
    for name in ("observations", "next_observations", "actions", "rewards", "dones"):
        arr = getattr(theirs, name)
        arr[:steps] = rng.standard_normal(arr[:steps].shape).astype(arr.dtype)
    theirs.pos, theirs.full = steps % (capacity // streams), steps == capacity // streams
    return ours, theirs


def fill_sweep(sr: Any, sb3_cls: Any, spaces: Any, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """Sample times at each fill, capacity and stream count (see the module docstring)."""
    rows = []
    for capacity in settings["capacities"]:
        for streams in settings["streams"]:
            for fill in settings["fills"]:
                steps = max(EPISODE, int(capacity // streams * fill))
                ours, theirs = _fill(sr, sb3_cls, spaces, capacity, streams, steps)
                rows.append({"capacity": capacity, "streams": streams, "fill": fill,
                             **_samples(ours, theirs, SAMPLE_BATCH, settings)})
                ours = theirs = None
                gc.collect()
    return rows


def _samples(ours: Any, theirs: Any, batch: int, settings: dict[str, Any]) -> dict[str, Any]:
    """``sample(batch)`` and ``sample_transitions(batch)`` against SB3's ``sample(batch)``."""
    kw = {"blocks": settings["blocks"], "calls": settings["calls"]}
    return {"sample": interleaved(lambda: ours.sample(batch), lambda: theirs.sample(batch), **kw),
            "sample_transitions": interleaved(lambda: ours.sample_transitions(batch, 0.99),
                                              lambda: theirs.sample(batch), **kw)}


def _kind_spec(sr: Any, kind: str) -> Any:
    if kind == "pixel":
        return sr.Spec({"obs": sr.Field((4, 84, 84), np.uint8, frame_stack=True),
                        "action": sr.Field((), np.int64), "reward": sr.Field((), np.float32)})
    if kind == "float":
        return sr.Spec({"obs": sr.Field((3,), np.float32), "action": sr.Field((1,), np.float32),
                        "reward": sr.Field((), np.float32)})
    return sr.Spec({"obs": sr.Field((4,), np.float32), "action": sr.Field((), np.int64),
                    "reward": sr.Field((), np.float32)})


def _kind_pool(kind: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``POOL`` env steps of one env: obs ``[POOL + 1, 1, ...]`` (stacks that roll for
    pixels), actions, rewards, done flags every ``EPISODE`` steps."""
    n = POOL
    if kind == "pixel":
        frames = rng.integers(0, 255, (n + 4, 84, 84), dtype=np.uint8)
        obs = np.lib.stride_tricks.sliding_window_view(frames, 4, axis=0).transpose(0, 3, 1, 2)
        obs = np.ascontiguousarray(obs[:n + 1])[:, None]
        action = rng.integers(0, 4, (n, 1))
    elif kind == "float":
        obs = rng.standard_normal((n + 1, 1, 3), dtype=np.float32)
        action = rng.uniform(-2, 2, (n, 1, 1)).astype(np.float32)
    else:
        obs = rng.standard_normal((n + 1, 1, 4), dtype=np.float32)
        action = rng.integers(0, 2, (n, 1))
    done = (np.arange(n) % EPISODE == EPISODE - 1)[:, None]
    return {"obs": obs, "action": action, "reward": np.ones((n, 1), np.float32), "done": done}


def _sb3_for(kind: str, sb3_cls: Any, spaces: Any, capacity: int) -> Any:
    if kind == "pixel":
        obs_space = spaces.Box(0, 255, (4, 84, 84), np.uint8)
        act_space = spaces.Discrete(4)
    elif kind == "float":
        obs_space = spaces.Box(-np.inf, np.inf, (3,), np.float32)
        act_space = spaces.Box(-2.0, 2.0, (1,), np.float32)
    else:
        obs_space = spaces.Box(-np.inf, np.inf, (4,), np.float32)
        act_space = spaces.Discrete(2)
    return sb3_cls(capacity, obs_space, act_space, "cpu", handle_timeout_termination=False)


class _Steps:
    """One env stepping through a pool, into shardreplay (writer or add) and SB3."""

    def __init__(self, sr: Any, kind: str, pool: dict[str, np.ndarray], ours: Any, theirs: Any,
                 via: str) -> None:
        self.pool, self.ours, self.theirs, self.i, self.j = pool, ours, theirs, 0, 0
        self.infos: list[dict[str, Any]] = [{}]
        self.via = via
        if via == "writer":
            self.writer = sr.GymStepWriter(ours, autoreset_mode="next_step")
            self.writer.reset(pool["obs"][0])
        self.zero = np.zeros(1, np.bool_)
        self.types = [np.array([t], np.uint8) for t in (0, 1, 2)]
        self.last = True
        self.empty: dict[str, Any] = {}

    def add_ours(self) -> None:
        p, k = self.pool, self.i % POOL
        self.i += 1
        if self.via == "writer":
            self.writer.step(p["action"][k], p["obs"][k + 1], p["reward"][k], p["done"][k], self.zero,
                             self.empty)
            return
        # ReplayBuffer.add: dm_env steps (obs, the action taken there, its reward).
        t = 0 if self.last else (2 if p["done"][k][0] else 1)
        self.last = t == 2
        self.ours.add({"obs": p["obs"][k], "action": p["action"][k], "reward": p["reward"][k],
                       "step_type": self.types[t]})

    def add_theirs(self) -> None:
        p, k = self.pool, self.j % POOL
        self.j += 1
        self.theirs.add(p["obs"][k], p["obs"][k + 1], p["action"][k], p["reward"][k], p["done"][k],
                        self.infos)


def add_sweep(sr: Any, sb3_cls: Any, spaces: Any, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """One-step add and sample times per field kind (see the module docstring)."""
    rows = []
    kw = {"blocks": settings["blocks"], "calls": settings["calls"]}
    for kind in ("vector", "float", "pixel"):
        pool = _kind_pool(kind, np.random.default_rng(1))
        capacity = PIXEL_CAPACITY if kind == "pixel" else 1_000_000
        batch = PIXEL_BATCH if kind == "pixel" else SAMPLE_BATCH
        fill = settings["pixel_fill"] if kind == "pixel" else 20_000
        row: dict[str, Any] = {"kind": kind}
        for via in ("writer", "add"):
            ours = sr.ReplayBuffer(_kind_spec(sr, kind), num_streams=1, stream_capacity=capacity, seed=0)
            theirs = _sb3_for(kind, sb3_cls, spaces, capacity)
            try:
                steps = _Steps(sr, kind, pool, ours, theirs, via)
            except sr.ConfigError as exc:  # a field kind this path does not take
                row[f"add_{via}"] = {"unsupported": str(exc)[:120]}
                continue
            # Enough steps for the timed blocks and the fill, alternating as timed.
            per = max(kw["calls"], fill // (2 * kw["blocks"] + 2))
            # The warm-up passes the adds after which a buffer builds its one-step path
            # (compiled once: it would otherwise land in a timed block).
            row[f"add_{via}"] = interleaved(steps.add_ours, steps.add_theirs, blocks=kw["blocks"], calls=per,
                                            warmup=ONE_STEP_WARMUP)
            if via == "add":
                row.update(_samples(ours, theirs, batch, settings))
                row["steps_stored"] = ours.num_steps
            ours = theirs = steps = None
            gc.collect()
            if kind == "pixel":
                row[f"add_{via}_warm"] = _warm_pixel_adds(sr, sb3_cls, spaces, pool, via, kw)
        rows.append(row)
    return rows


def _warm_pixel_adds(sr: Any, sb3_cls: Any, spaces: Any, pool: dict[str, np.ndarray], via: str,
                     kw: dict[str, int]) -> dict[str, float]:
    """Pixel adds into buffers of ``WARM_PIXEL_CAPACITY`` steps that have wrapped (SB3's
    arrays all touched, as in a long run; ours too), in alternating blocks."""
    ours = sr.ReplayBuffer(_kind_spec(sr, "pixel"), num_streams=1, stream_capacity=WARM_PIXEL_CAPACITY,
                           seed=0)
    theirs = _sb3_for("pixel", sb3_cls, spaces, WARM_PIXEL_CAPACITY)
    steps = _Steps(sr, "pixel", pool, ours, theirs, via)
    got = interleaved(steps.add_ours, steps.add_theirs, blocks=kw["blocks"], calls=max(kw["calls"], 500),
                      warmup=WARM_PIXEL_CAPACITY + ONE_STEP_WARMUP)
    got["sb3_wrapped"] = bool(theirs.full)
    return got


def build_seconds(sr: Any) -> float:
    """Seconds to construct a ``BUILD_CAPACITY``-step frame-stacked buffer."""
    start = time.perf_counter()
    buf = sr.ReplayBuffer(_kind_spec(sr, "pixel"), num_streams=1, stream_capacity=BUILD_CAPACITY)
    took = time.perf_counter() - start
    del buf
    return round(took, 3)


def run(quick: bool = False, clock: str = "wall") -> dict[str, Any]:
    """The whole sweep as a dict (``quick``: smaller sizes, for smoke tests; ``clock``:
    ``"wall"`` or ``"cpu"``).

    Raises:
        ImportError: stable-baselines3 or gymnasium is not installed.
    """
    from gymnasium import spaces
    from stable_baselines3.common.buffers import ReplayBuffer as Sb3Buffer

    import shardreplay as sr

    global _clock
    _clock = _CLOCKS[clock]
    np.random.seed(0)  # SB3 samples from numpy's global generator
    settings = QUICK if quick else FULL
    return {"settings": {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()},
            "clock": clock,
            "build_pixel_1m_s": build_seconds(sr),
            "add": add_sweep(sr, Sb3Buffer, spaces, settings),
            "fill": fill_sweep(sr, Sb3Buffer, spaces, settings)}
