"""TensorDicts in and out (buffer/tensordicts.py): TorchRL transitions stored as steps and
sampled back with TorchRL's names, into TorchRL's DQNLoss and SACLoss unchanged.

Cost: about 10 s of CPU in all (importing torchrl is most of it; the sharded test adds a
2-rank launch and is marked distributed).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import shardreplay as sr
from tests.support import run_ranks

tensordict = pytest.importorskip("tensordict")
TensorDict = tensordict.TensorDict

SPEC = sr.Spec({"obs": sr.Field((3,), np.float32), "action": sr.Field((), np.int64),
                "reward": sr.Field((), np.float32)})


def torchrl_rollout(streams: int, steps: int, seed: int, start: int = 0) -> TensorDict:
    """TorchRL-shaped transitions ``[streams, steps]`` of a made-up env: o = (stream,
    time, episode) so every row is unique; episodes end at random by termination or
    truncation; after an end the next row holds the reset observation. ``start`` is the
    time of the first row (a second rollout continues the first)."""
    rng = np.random.default_rng(seed)
    obs = np.zeros((streams, steps + 1, 3), np.float32)
    term, trunc = rng.random((streams, steps)) < 0.12, rng.random((streams, steps)) < 0.06
    trunc &= ~term
    nxt = np.zeros((streams, steps, 3), np.float32)
    for s in range(streams):
        episode = 0
        obs[s, 0] = (s, start, 0)
        for t in range(steps):
            nxt[s, t] = (s, start + t + 1, episode)
            if term[s, t] or trunc[s, t]:
                episode += 1
                obs[s, t + 1] = (s, -(start + t + 1), episode)  # the reset observation
            else:
                obs[s, t + 1] = nxt[s, t]
    done = term | trunc
    return TensorDict({
        "observation": torch.from_numpy(obs[:, :-1]),
        "action": torch.from_numpy(rng.integers(0, 4, (streams, steps))),
        "done": torch.zeros(streams, steps, 1, dtype=torch.bool),  # root flags: ignored
        "collector": {"traj_ids": torch.zeros(streams, steps, dtype=torch.int64)},
        "next": {"observation": torch.from_numpy(nxt),
                 "reward": torch.from_numpy(rng.random((streams, steps, 1)).astype(np.float32)),
                 "done": torch.from_numpy(done[..., None]), "terminated": torch.from_numpy(term[..., None]),
                 "truncated": torch.from_numpy(trunc[..., None])},
    }, batch_size=[streams, steps])


def rows_by_observation(td: TensorDict) -> dict[tuple[float, ...], TensorDict]:
    flat = td.reshape(-1)
    return {tuple(flat["observation"][i].tolist()): flat[i] for i in range(flat.shape[0])}


def test_torchrl_transitions_round_trip_through_extend_and_sample_as_tensordict() -> None:
    rb = sr.ReplayBuffer(SPEC, num_streams=3, stream_capacity=200, window=2, seed=0)
    first, second = torchrl_rollout(3, 40, seed=1), torchrl_rollout(3, 30, seed=2, start=40)
    # The second rollout continues the first: its first rows are the first's next observations
    # (or reset observations where the first one's last row ended an episode).
    ended = first["next", "done"][:, -1, 0]
    second["observation"][:, 0] = torch.where(ended[:, None], torch.tensor([0.0, -40.0, 0.0]) +
                                              first["next", "observation"][:, -1] * torch.tensor([1, 0, 1]),
                                              first["next", "observation"][:, -1])
    rb.extend(first)
    rb.extend(second)
    ends = int(first["next", "done"].sum() + second["next", "done"].sum())
    assert rb.num_steps == 3 * 70 + ends  # one LAST step per ended episode
    # Every row starts a window but a stream's newest, unless a LAST step follows it.
    assert len(rb) == 3 * 70 - int((~second["next", "done"][:, -1]).sum())
    rows = rows_by_observation(torch.cat([first, second], dim=1))
    out = rb.sample(2000, as_tensordict=True)
    assert out.batch_size == torch.Size([2000]) and out["next", "reward"].shape == (2000, 1)
    seen = set()
    for i in range(2000):
        got, key = out[i], tuple(out["observation"][i].tolist())
        want = rows[key]
        seen.add(key)
        assert got["action"] == want["action"]
        for k in ("observation", "reward", "done", "terminated", "truncated"):
            assert torch.equal(got["next", k], want["next", k]), (key, k)
        assert got["steps_to_next_obs"].item() == 1 and got["priority_weight"] == 1.0
        assert got["bootstrap_discount"] == (0.0 if want["next", "terminated"] else 1.0)
    assert len(seen) == len(rb)  # every stored transition came back


def test_add_of_one_row_per_stream_stores_what_extend_stores() -> None:
    td = torchrl_rollout(2, 30, seed=3)
    a, b = (sr.ReplayBuffer(SPEC, num_streams=2, stream_capacity=64, window=3, sampler="prioritized", seed=0)
            for _ in range(2))
    a.extend(td, priorities=torch.arange(60, dtype=torch.float32).reshape(2, 30))
    for t in range(30):
        b.add(td[:, t], priorities=torch.arange(2, dtype=torch.float32) * 30 + t)
    sa, sb = a.state_dict()["arrays"], b.state_dict()["arrays"]
    # Episode ids count episodes in the order they are written (extend writes stream by
    # stream): the same episodes, numbered apart.
    ea, eb = sa.pop("episode_id"), sb.pop("episode_id")
    assert torch.equal(ea.diff() != 0, eb.diff() != 0)
    for name, arr in sa.items():
        assert torch.equal(arr, sb[name]), name


def test_a_tensordict_of_steps_stores_what_the_dict_stores() -> None:
    spec = sr.Spec({"obs": {"pos": sr.Field((2,), np.float32), "vel": sr.Field((), np.float32)},
                    "action": sr.Field((), np.int64), "reward": sr.Field((), np.float32)})
    rng = np.random.default_rng(4)
    step = {"obs": {"pos": rng.random((2, 5, 2), np.float32), "vel": rng.random((2, 5), np.float32)},
            "action": rng.integers(0, 3, (2, 5)), "reward": rng.random((2, 5), np.float32),
            "step_type": np.array([[0, 1, 1, 2, 0]] * 2, np.uint8),
            "discount": np.array([[1, 1, 1, 0, 1]] * 2, np.float32)}
    a, b = (sr.ReplayBuffer(spec, num_streams=2, stream_capacity=16, window=2, seed=0) for _ in range(2))
    a.extend(step)
    b.extend(TensorDict({"obs": {k: torch.from_numpy(v) for k, v in step["obs"].items()},
                         **{k: torch.from_numpy(v) for k, v in step.items() if k != "obs"}},
                        batch_size=[2, 5]))
    for name, arr in a.state_dict()["arrays"].items():
        assert torch.equal(arr, b.state_dict()["arrays"][name]), name
    out = b.sample(4, as_tensordict=True)
    assert set(out["observation"].keys()) == {"pos", "vel"}  # nested fields: a nested TensorDict


def test_rows_that_are_not_consecutive_steps_are_refused_and_nothing_is_written() -> None:
    rb = sr.ReplayBuffer(SPEC, num_streams=3, stream_capacity=64, window=2, seed=0)
    td = torchrl_rollout(3, 10, seed=5)
    with pytest.raises(sr.SpecMismatchError, match="consecutive"):
        rb.extend(td.transpose(0, 1)[:3, :3].contiguous().clone())  # time first: wrong
    shuffled = td.clone()
    shuffled["observation"] = shuffled["observation"].flip(1)
    with pytest.raises(sr.SpecMismatchError, match="consecutive"):
        rb.extend(shuffled)
    missing = td.exclude(("next", "observation"))
    if bool(td["next", "done"].any()):
        with pytest.raises(sr.SpecMismatchError, match="final observation"):
            rb.extend(missing)
    with pytest.raises(sr.ConfigError, match="gamma="):
        sr.ReplayBuffer(SPEC, num_streams=1, stream_capacity=8, window=3).sample(1, as_tensordict=True)
    assert rb.num_steps == 0


def _dqn_setup(gamma: float):
    from torchrl.data import Categorical
    from torchrl.modules import MLP, QValueActor
    from torchrl.objectives import DQNLoss

    torch.manual_seed(0)
    qnet = QValueActor(MLP(in_features=3, out_features=4, num_cells=[16]), in_keys=["observation"],
                       spec=Categorical(4))
    loss = DQNLoss(qnet, action_space="categorical", delay_value=False, loss_function="l2")
    loss.make_value_estimator(gamma=gamma)
    return qnet, loss


def test_torchrl_dqn_loss_takes_our_n_step_batch_unchanged_and_its_targets_are_ours() -> None:
    gamma = 0.9
    rb = sr.ReplayBuffer(SPEC, num_streams=3, stream_capacity=100, window=4, sampler="prioritized", seed=0)
    rb.extend(torchrl_rollout(3, 60, seed=6))
    td = rb.sample(256, as_tensordict=True, gamma=gamma)
    assert int(td["steps_to_next_obs"].min()) == 1 and int(td["steps_to_next_obs"].max()) == 3
    assert bool(td["next", "terminated"].any()) and bool(td["next", "truncated"].any())
    qnet, loss = _dqn_setup(gamma)
    out = loss(td)
    out["loss"].backward()
    grads = [p.grad for p in loss.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    # TorchRL's target, from its td_error (a squared error), is ours: R + bootstrap_discount *
    # max_a Q(o_m, a), the discount of m steps and terminations included.
    mlp = qnet.module[0].module
    with torch.no_grad():
        q = mlp(td["observation"]).gather(1, td["action"][:, None]).squeeze(1)
        target = td["next", "reward"][:, 0] + td["bootstrap_discount"] * \
            mlp(td["next", "observation"]).max(dim=1).values
    torch.testing.assert_close(td["td_error"].reshape(-1), (q - target) ** 2, rtol=1e-4, atol=1e-5)
    assert rb.update_priorities(td["index"], td["td_error"]) == 256


def test_torchrl_sac_loss_runs_forward_and_backward_on_our_batch() -> None:
    from tensordict.nn import NormalParamExtractor, TensorDictModule
    from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
    from torchrl.objectives import SACLoss, SoftUpdate

    torch.manual_seed(0)
    spec = sr.Spec({"obs": sr.Field((3,), np.float32), "action": sr.Field((1,), np.float32),
                    "reward": sr.Field((), np.float32)})
    rb = sr.ReplayBuffer(spec, num_streams=2, stream_capacity=64, window=2, seed=0)
    td = torchrl_rollout(2, 40, seed=7)
    td["action"] = torch.rand(2, 40, 1) * 2 - 1
    rb.extend(td)
    batch = rb.sample(32, as_tensordict=True)
    actor = ProbabilisticActor(
        TensorDictModule(torch.nn.Sequential(MLP(in_features=3, out_features=2, num_cells=[16]),
                                             NormalParamExtractor()),
                         in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"], distribution_class=TanhNormal, return_log_prob=True)
    qvalue = ValueOperator(MLP(in_features=4, out_features=1, num_cells=[16]),
                           in_keys=["observation", "action"])
    loss = SACLoss(actor, qvalue, num_qvalue_nets=2, target_entropy=-1.0)
    loss.make_value_estimator(gamma=0.99)
    updater = SoftUpdate(loss, eps=0.995)  # what a training loop pairs with the loss
    out = loss(batch)
    total = out["loss_actor"] + out["loss_qvalue"] + out["loss_alpha"]
    total.backward()
    assert torch.isfinite(total)
    grads = [p.grad for p in loss.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    updater.step()  # the target networks move toward the trained ones


def test_without_tensordict_the_buffer_works_and_as_tensordict_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['tensordict'] = None\n"  # an import of it fails, as when absent
        "import numpy as np, shardreplay as sr\n"
        "spec = sr.Spec({'obs': sr.Field((), np.float32), 'action': sr.Field((), np.int64),"
        " 'reward': sr.Field((), np.float32)})\n"
        "rb = sr.ReplayBuffer(spec, num_streams=1, stream_capacity=8, window=2)\n"
        "for t in range(4):\n"
        "    rb.add({'obs': [t], 'action': [0], 'reward': [1.0], 'step_type': [min(t, 1)]})\n"
        "assert len(rb.sample(2)) == 2\n"
        "try:\n"
        "    rb.sample(2, as_tensordict=True)\n"
        "except sr.ConfigError as exc:\n"
        "    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'shardreplay[tensordict]'" in proc.stdout


def _sharded(rank: int, world: int) -> dict:
    from shardreplay.distributed import ShardedReplayBuffer

    local = sr.ReplayBuffer(SPEC, num_streams=2, stream_capacity=64, window=2, sampler="prioritized",
                            seed=rank)
    sharded = ShardedReplayBuffer(local, timeout_s=60)
    td = torchrl_rollout(2, 20, seed=10 + rank)
    td["observation"][..., 0] += 10 * rank  # the stream coordinate names the rank
    td["next", "observation"][..., 0] += 10 * rank
    sharded.extend(td)
    out = sharded.sample(64, as_tensordict=True)
    sharded.update_priorities(out["index"], out["priority_weight"] + 1.0)
    from shardreplay.spec.keys import key_shard

    return {"owner": key_shard(out["index"].numpy()).tolist(),
            "rank_of_obs": (out["observation"][:, 0] // 10).int().tolist(),
            "weights_ok": bool((out["priority_weight"] <= 1.0).all())}


@pytest.mark.distributed
def test_a_sharded_buffer_takes_and_returns_tensordicts() -> None:
    results = run_ranks(_sharded, 2)
    for r in results:
        assert r["owner"] == r["rank_of_obs"] and r["weights_ok"]
    assert {o for r in results for o in r["owner"]} == {0, 1}
