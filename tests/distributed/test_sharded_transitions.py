"""ShardedReplayBuffer.sample_transitions on real gloo ranks: n-step transitions of global samples."""

from __future__ import annotations

import numpy as np
import pytest

import shardreplay as sr
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.spec.keys import key_shard
from tests.support import run_ranks

pytestmark = pytest.mark.distributed

SPEC = sr.Spec({"obs": sr.Field((), np.float32), "action": sr.Field((), np.int64),
                "reward": sr.Field((), np.float32)})


def _transitions(rank: int, world: int) -> dict:
    local = sr.ReplayBuffer(SPEC, num_streams=2, stream_capacity=100, window=3, sampler="prioritized",
                            seed=rank)
    for t in range(60):  # obs = 1000 * rank + t, reward 1; episodes of 20 steps, terminated
        st = sr.StepType.FIRST if t % 20 == 0 else sr.StepType.LAST if t % 20 == 19 else sr.StepType.MID
        local.add({"obs": np.full(2, 1000 * rank + t, np.float32), "action": [t, t], "reward": [1.0, 1.0],
                   "step_type": [st, st], "discount": [0.0 if st == sr.StepType.LAST else 1.0] * 2})
    buf = ShardedReplayBuffer(local, timeout_s=30)
    tr = buf.sample_transitions(64, gamma=0.5)
    one = ShardedReplayBuffer(local, timeout_s=30, mode="local").sample_transitions(64, gamma=0.5, n=1)
    return {"obs": tr.obs.tolist(), "next_obs": tr.next_obs.tolist(), "reward": tr.reward.tolist(),
            "boot": tr.bootstrap_discount.tolist(), "owner": key_shard(tr.keys.numpy()).tolist(),
            "one_reward": one.reward.tolist(), "one_boot": one.bootstrap_discount.tolist()}


def test_two_ranks_get_exact_two_step_transitions_from_both_shards() -> None:
    results = run_ranks(_transitions, 2)
    owners = set()
    for r in results:
        for o, no, rew, boot, owner in zip(r["obs"], r["next_obs"], r["reward"], r["boot"], r["owner"],
                                           strict=True):
            owners.add(owner)
            assert o // 1000 == owner  # the data came from the shard that owns the key
            if o % 20 == 18:  # one step before the termination
                assert (no - o, rew, boot) == (1, 1.0, 0.0)
            elif o % 20 == 17:  # two steps: the termination ends the window
                assert (no - o, rew, boot) == (2, 1.5, 0.0)
            else:
                assert (no - o, rew, boot) == (2, 1.5, 0.25)
        assert set(r["one_reward"]) == {1.0} and set(r["one_boot"]) <= {0.0, 0.5}
    assert owners == {0, 1}
