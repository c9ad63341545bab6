"""The single-env case of the replay benchmark: one env, one step per add, 128 transitions.

This is the loop of CleanRL's dqn.py: after every ``env.step`` the buffer gets what the
env returned, and every few steps the learner samples a batch of 128 transitions as
torch tensors. Peers:

* ``shardreplay``: :class:`GymStepWriter.step` (the gymnasium -> dm_env conversion
  included) and :meth:`ReplayBuffer.sample_transitions` (1-step, gamma 0.99: reward,
  bootstrap discount, obs, next obs, action, weights, keys);
* ``sb3``: stable-baselines3's ``ReplayBuffer.add(obs, next_obs, action, reward, done,
  infos)`` and ``sample(128)`` (observations, actions, next observations, dones, rewards).

The steps are CartPole's shapes (obs float32[4], a discrete action, float64 reward), made
once (seeded, an episode ends on average every 50 steps) and cycled through; the timed
loops do nothing but the library's calls. The buffer holds ``CAPACITY`` steps and is full
before sampling is timed.
"""

from __future__ import annotations

import importlib.metadata as im
from typing import Any

import numpy as np
import replay_workload as W

CAPACITY = 100_000
SAMPLE_BATCH = 128
GAMMA = 0.99
OBS_DIM = 4
POOL = 8_192
ADD_BLOCK_CALLS = 2_000
PEERS = ("shardreplay", "sb3")


class MissingPeer(Exception):
    """The peer library cannot be imported."""


def gym_outputs(seed: int, n: int = POOL) -> dict[str, np.ndarray]:
    """``n`` steps of one env as gymnasium returns them: rows ``[n, 1, ...]``."""
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.standard_normal((n + 1, 1, OBS_DIM), dtype=np.float32),
        "action": rng.integers(0, 2, size=(n, 1), dtype=np.int64),
        "reward": np.ones((n, 1), np.float64),
        "terminated": rng.random((n, 1)) < 0.02,
        "truncated": np.zeros((n, 1), bool),
    }


class ShardReplayOneEnv:
    """GymStepWriter into a uniform ReplayBuffer; sample_transitions."""

    def __init__(self, seed: int) -> None:
        import shardreplay

        self._sr, self._seed = shardreplay, seed
        self._pool = gym_outputs(seed)
        self._info: dict[str, Any] = {}

    def versions(self) -> dict[str, Any]:
        """The library's version."""
        return {"version": self._sr.__version__}

    def create(self, capacity: int) -> None:
        """An empty buffer of ``capacity`` steps and a writer reset at the pool's first obs."""
        sr = self._sr
        spec = sr.Spec({"obs": sr.Field((OBS_DIM,), np.float32), "action": sr.Field((), np.int64),
                        "reward": sr.Field((), np.float32)})
        self.buf = sr.ReplayBuffer(spec, num_streams=1, stream_capacity=capacity, window=2, seed=self._seed)
        self.writer = sr.GymStepWriter(self.buf, autoreset_mode="next_step")
        self.writer.reset(self._pool["obs"][0])

    def add(self, i: int) -> None:
        """One env step."""
        p, k = self._pool, i % POOL
        self.writer.step(p["action"][k], p["obs"][k + 1], p["reward"][k], p["terminated"][k],
                         p["truncated"][k], self._info)

    def sample(self, i: int) -> Any:
        """128 one-step transitions."""
        return self.buf.sample_transitions(SAMPLE_BATCH, gamma=GAMMA)


class Sb3OneEnv:
    """stable-baselines3's ReplayBuffer (n_envs=1), as CleanRL's dqn.py uses it."""

    def __init__(self, seed: int) -> None:
        try:
            import torch
            from gymnasium import spaces
            from stable_baselines3.common.buffers import ReplayBuffer
        except ImportError as exc:
            raise MissingPeer(f"stable-baselines3: {exc}") from exc
        self._cls, self._spaces, self._torch = ReplayBuffer, spaces, torch
        self._pool = gym_outputs(seed)
        self._infos: list[dict[str, Any]] = [{}]
        np.random.seed(seed)  # SB3 draws from numpy's global generator

    def versions(self) -> dict[str, Any]:
        """Versions of the library and torch."""
        return {"version": im.version("stable-baselines3"), "torch": self._torch.__version__}

    def create(self, capacity: int) -> None:
        """An empty buffer of ``capacity`` transitions (CleanRL's settings)."""
        sp = self._spaces
        self.buf = self._cls(capacity, sp.Box(-np.inf, np.inf, (OBS_DIM,), np.float32), sp.Discrete(2),
                             "cpu", handle_timeout_termination=False)

    def add(self, i: int) -> None:
        """One env step (obs, next obs, action, reward, done, infos)."""
        p, k = self._pool, i % POOL
        self.buf.add(p["obs"][k], p["obs"][k + 1], p["action"][k], p["reward"][k], p["terminated"][k],
                     self._infos)

    def sample(self, i: int) -> Any:
        """128 transitions."""
        return self.buf.sample(SAMPLE_BATCH)


CASES = {"shardreplay": ShardReplayOneEnv, "sb3": Sb3OneEnv}


def run(libraries: list[str], n_insert: int, *, calls: int, blocks: int, warmup: int, seed: int
        ) -> dict[str, Any]:
    """Time each library's single-env adds (filling a buffer of ``CAPACITY`` steps, or
    ``n_insert`` when smaller) and 128-transition samples, the libraries' blocks alternated
    (one block of each in turn), so a change of load lands on all of them; per library its
    figures as a dict, or ``missing`` when it cannot be imported. With ``sb3`` beside
    shardreplay, shardreplay's figures add ``<rate>_vs_sb3``: the median over rounds of the
    speed ratio of its block to SB3's block of the same round, with its range and quartiles.
    """
    out: dict[str, dict[str, Any]] = {}
    cases = {}
    for library in libraries:
        try:
            cases[library] = CASES[library](seed)
        except MissingPeer as exc:
            out[library] = {"missing": str(exc)}
    for library, case in cases.items():
        out[library] = {**case.versions()}
        case.create(1_000)  # compiled code and first-call set-up, untimed
        for i in range(1_000):
            case.add(i)
        case.sample(0)
    capacity = min(CAPACITY, n_insert)
    for case in cases.values():
        case.create(capacity)
    timed = (("add", min(ADD_BLOCK_CALLS, capacity), max(1, capacity // ADD_BLOCK_CALLS), 0),
             ("sample", calls, blocks, warmup))
    for name, n, rounds, warm in timed:
        rates: dict[str, list[float]] = {library: [] for library in cases}
        for r in range(rounds):
            for library, case in cases.items():
                fn = getattr(case, name)
                rates[library].append(W.time_calls(lambda i, f=fn, o=r * n: f(o + i), calls=n, blocks=1,
                                                   warmup=warm if r == 0 else 0)[0])
        for library, got in rates.items():
            W.put_rate(out[library], f"{name}_calls_per_s", (np.median(got), min(got), max(got)),
                       SAMPLE_BATCH if name == "sample" else 0, "sample_transitions_per_s")
            out[library][f"{name}_us"] = round(1e6 / out[library][f"{name}_calls_per_s"], 2)
            out[library]["capacity"] = capacity
        if "shardreplay" in rates and "sb3" in rates:
            ratio = np.asarray(rates["shardreplay"]) / np.asarray(rates["sb3"])
            key = f"{name}_calls_per_s_vs_sb3"
            low, q1, mid, q3, high = (round(float(q), 3) for q in np.quantile(ratio, [0, 0.25, 0.5, 0.75, 1]))
            out["shardreplay"].update({key: mid, key + "_range": [low, high], key + "_quartiles": [q1, q3]})
    return out
