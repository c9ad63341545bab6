"""GymStepWriter on a ShardedReplayBuffer (2 real gloo ranks): each rank's envs go into
its own shard, exactly as a GymStepConverter + ReplayBuffer.add store them, and the
global sample reads both shards. Also: one documented constructor (from_env).

Cost: one 2-rank launch, about 6 s on 2 cores (most of it importing torch twice).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import shardreplay as sr
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.spec.keys import key_shard
from tests.support import run_ranks

PLAIN = sr.Spec({"obs": sr.Field((3,), np.float32), "action": sr.Field((), np.int64),
                 "reward": sr.Field((), np.float32)})
STACKED = sr.Spec({"obs": sr.Field((4, 3, 2), np.uint8, frame_stack=True),
                   "action": sr.Field((), np.int64), "reward": sr.Field((), np.float32)})
NUM_ENVS = 2


class _Envs:
    """What from_env reads of a gymnasium vector env: its size and autoreset mode."""

    def __init__(self, mode: str) -> None:
        self.num_envs = NUM_ENVS
        self.metadata = {"autoreset_mode": mode}


def _obs(spec: sr.Spec, rank: int, episode: int, t: int) -> np.ndarray:
    """One env's observation at step ``t`` of ``episode``; its first value names the rank.
    Frame stacks hold frames ``t-3 .. t``, so consecutive steps continue their stack."""
    field = spec["obs"]
    if not field.frame_stack:
        return np.array([1000 * rank, episode, t], np.float32)
    stack = np.empty(field.shape, np.uint8)
    for i in range(field.shape[0]):
        stack[i] = (episode * 37 + t - (field.shape[0] - 1 - i)) % 97
    stack[:, 0, 0] = 100 + rank
    return stack


def _drive(rank: int, spec: sr.Spec, mode: str, pipeline: bool) -> dict[str, Any]:
    """One rank writes its envs through a writer on the sharded buffer and through the
    converter into a plain buffer; both shards are compared, then sampled globally."""
    local, ref = (sr.ReplayBuffer(spec, num_streams=NUM_ENVS, stream_capacity=40, window=3, seed=rank)
                  for _ in range(2))
    sharded = ShardedReplayBuffer(local, timeout_s=60, pipeline=pipeline)
    try:
        writer = sr.GymStepWriter.from_env(_Envs(mode), sharded)
        conv = sr.GymStepConverter(NUM_ENVS, autoreset_mode=mode)
        rng = np.random.default_rng(rank)
        episode, step, ended = [0] * NUM_ENVS, [0] * NUM_ENVS, [False] * NUM_ENVS
        obs = np.stack([_obs(spec, rank, 0, 0) for _ in range(NUM_ENVS)])
        writer.reset(obs)
        conv.reset(obs)
        for t in range(60):
            action, reward = rng.integers(0, 3, NUM_ENVS), rng.random(NUM_ENVS).astype(np.float32)
            term, trunc = np.array([t % 9 == 8, False]), np.array([False, t % 13 == 12])
            rows, finals = [], []
            for e in range(NUM_ENVS):
                if ended[e]:  # NEXT_STEP: this call resets the env (reward 0, action ignored)
                    episode[e], step[e], ended[e] = episode[e] + 1, 0, False
                    reward[e] = 0.0
                else:
                    step[e] += 1
                done = bool(term[e] or trunc[e])
                finals.append(_obs(spec, rank, episode[e], step[e]) if done else None)
                if done and mode == "same_step":
                    episode[e], step[e] = episode[e] + 1, 0
                ended[e] = done and mode == "next_step"
                rows.append(_obs(spec, rank, episode[e], step[e]))
            obs = np.stack(rows)
            info = {"final_obs": np.array(finals, dtype=object)} if mode == "same_step" else {}
            writer.step(action, obs, reward, term, trunc, info)
            for written, ids in conv.step(action, obs, reward, term, trunc, info):
                ref.add(written, stream_ids=ids)
        mine, theirs = local.state_dict()["arrays"], ref.state_dict()["arrays"]
        same = all(np.array_equal(mine[k], theirs[k]) for k in theirs)
        batch = sharded.sample(64)
        first = batch.data["obs"][:, 0].reshape(64, -1)[:, 0].numpy()
        owners = key_shard(batch.keys.numpy())
        return {"same": same, "steps": local.num_steps, "episodes": writer.num_episodes,
                "owners": owners.tolist(), "first": first.tolist()}
    finally:
        sharded.close()


def _both_cases(rank: int, world: int) -> list[dict[str, Any]]:
    return [_drive(rank, PLAIN, "next_step", pipeline=False),
            _drive(rank, STACKED, "same_step", pipeline=True)]


@pytest.mark.distributed
def test_the_writer_fills_each_ranks_shard_and_the_sample_is_global() -> None:
    results = run_ranks(_both_cases, 2)
    for case in range(2):
        owners = set()
        for rank, per_rank in enumerate(results):
            r = per_rank[case]
            assert r["same"], (case, rank)  # the shard holds what the converter + add store
            assert r["steps"] == 80 and r["episodes"] == 10  # a full shard: 2 rings of 40
            owners |= set(r["owners"])
            if case == 0:
                assert [int(f // 1000) for f in r["first"]] == r["owners"]  # data from its owner
            else:
                assert [int(f) - 100 for f in r["first"]] == r["owners"]
        assert owners == {0, 1}


def test_a_writer_without_the_envs_mode_is_refused_at_construction_naming_from_env() -> None:
    buffer = sr.ReplayBuffer(PLAIN, num_streams=NUM_ENVS, stream_capacity=8, window=2)
    with pytest.raises(sr.ConfigError, match=r"GymStepWriter\.from_env\(envs, buffer\)"):
        sr.GymStepWriter(buffer)
    writer = sr.GymStepWriter.from_env(_Envs("same_step"), buffer)
    assert writer.autoreset_mode == "same_step"
