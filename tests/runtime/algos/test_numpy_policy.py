"""The default actor's policy without torch (runtime/algos/dqn.py): its Q-values
and greedy actions are the torch QNetwork's, its epsilon-greedy draws the torch policy's
for the same seed, and the default actor's whole path (entry, subscriber, policy, env,
chunker, chunk checks, spool) runs in a fresh interpreter without importing torch or numba.

Cost: about 2 CPU-s (the fresh interpreter: 0.5 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from shardreplay.errors import ConfigError
from shardreplay.runtime.actor.settings import ActorSettings
from shardreplay.runtime.algos.dqn import DQN, NumpyEpsilonGreedyPolicy, NumpyQNetwork
from shardreplay.runtime.algos.dqn_torch import EpsilonGreedyPolicy, q_network_of
from shardreplay.runtime.algos.networks import QNetwork
from shardreplay.runtime.envs import EnvInfo
from tests.runtime.runtime_helpers import publish_cartpole_policy

CARTPOLE = EnvInfo((4,), np.dtype(np.float32), 2)


def _weights(net: torch.nn.Module) -> dict[str, np.ndarray]:
    """Published weights as the actor's subscriber gives them: numpy arrays."""
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}


def _settings(**kw: object) -> ActorSettings:
    base: dict[str, object] = dict(actor_id=1, num_actors=3, num_shards=1, envs_per_actor=48,
                                   policy_url="file:///p", env_id="CartPole-v1", network="auto",
                                   hidden=(16,), epsilon_base=0.4, epsilon_exponent=7.0,
                                   epsilon_warmup_steps=100, seed=5)
    base.update(kw)
    return ActorSettings(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("hidden", [(), (8,), (32, 16), (64, 32, 8)])
def test_q_values_and_greedy_actions_are_the_torch_networks(hidden: tuple[int, ...]) -> None:
    torch.manual_seed(len(hidden))
    net = QNetwork(6, 5, hidden)
    numpy_net = NumpyQNetwork(6, 5, hidden)
    numpy_net.load(_weights(net))
    obs = np.random.default_rng(len(hidden)).normal(0, 3, size=(512, 6)).astype(np.float32)
    with torch.no_grad():
        q_torch = net(torch.as_tensor(obs)).numpy()
    q = numpy_net(obs)
    assert q.dtype == np.float32 and q.shape == (512, 5)
    np.testing.assert_allclose(q, q_torch, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(numpy_net(obs.astype(np.float64)), q)  # cast first, as QNetwork does
    top = np.sort(q_torch, axis=1)
    clear = top[:, -1] - top[:, -2] > 1e-4  # ties aside: the libraries round sums differently
    assert clear.mean() > 0.95
    np.testing.assert_array_equal(q.argmax(axis=1)[clear], q_torch.argmax(axis=1)[clear])
    # evaluation still acts with the torch module's argmax
    np.testing.assert_array_equal(DQN.greedy(net)(torch.as_tensor(obs))[clear], q.argmax(axis=1)[clear])


def test_epsilon_greedy_draws_are_the_torch_policys_for_the_same_seed() -> None:
    torch.manual_seed(3)
    weights = _weights(QNetwork(4, 2, (16,)))
    s = _settings()
    numpy_policy = DQN.make_policy(weights, CARTPOLE, s)
    assert isinstance(numpy_policy, NumpyEpsilonGreedyPolicy)
    torch_policy = EpsilonGreedyPolicy(q_network_of(weights, CARTPOLE, s, "mlp"), s)
    torch_policy.load(weights)
    rng = np.random.default_rng(0)
    explored = []
    for run_steps in (0, 20, 50, 99, 100, 1000, 1000):
        obs = rng.normal(size=(48, 4)).astype(np.float32)
        with torch.no_grad():
            greedy = torch_policy.net(torch.as_tensor(obs)).argmax(dim=1).numpy()
        got, state = numpy_policy.act(obs, None, run_steps)
        want, _ = torch_policy.act(obs, None, run_steps)
        assert state is None and got.dtype == want.dtype == np.int64
        np.testing.assert_array_equal(got, want)
        explored.append(float((got != greedy).mean()))
    assert explored[0] > 0.3 and explored[-1] < 0.2  # warm-up: half the random draws differ


def test_images_keep_the_torch_policy_and_other_layers_are_refused() -> None:
    minatar = EnvInfo((4, 10, 10), np.dtype(np.uint8), 3)
    conv = DQN.policy_network(minatar, "auto", ())
    assert isinstance(DQN.make_policy(_weights(conv), minatar, _settings(env_id="MinAtar")),
                      EpsilonGreedyPolicy)
    policy = DQN.make_policy(_weights(QNetwork(4, 2, (16,))), CARTPOLE, _settings())
    with pytest.raises(ConfigError, match="not this actor's Q-network"):
        policy.load(_weights(QNetwork(4, 2, (8,))))  # the learners changed --hidden under it
    with pytest.raises(ConfigError, match="is not a Q-network for CartPole-v1"):
        DQN.make_policy(_weights(QNetwork(5, 2, (16,))), CARTPOLE, _settings())


def test_the_default_actor_runs_without_torch_or_numba_on_one_blas_thread(tmp_path: Path) -> None:
    """The spawned actor's entry, its policy built from published weights, and more than
    the first-writes budget of chunks checked and sent: neither torch nor numba loads, and
    numpy's OpenBLAS (one thread per core when it loads) is down to one thread."""
    publish_cartpole_policy(f"file://{tmp_path}/policy", 1)  # no run description: DQN, CartPole, MLP
    code = textwrap.dedent(f"""
        import json, sys, threading
        from shardreplay.runtime.actor.processes import _actor_main  # what spawn unpickles
        from shardreplay.runtime.actor.loop import ActorSettings, run
        from threadpoolctl import threadpool_info
        def blas_threads():  # the most threads a loaded BLAS uses (None: none loaded)
            counts = [int(p["num_threads"]) for p in threadpool_info() if p.get("user_api") == "blas"]
            return max(counts) if counts else None
        before = blas_threads()
        s = ActorSettings(actor_id=0, num_actors=1, num_shards=1, transport="file://{tmp_path}/spool",
                          policy_url="file://{tmp_path}/policy", hidden=(16,), seed=1,
                          queued_chunks_per_actor=256, max_env_steps=4 * 16 * 70)
        counters = run(s, stop=threading.Event())
        loaded = [m for m in ("torch", "numba") if m in sys.modules]
        print(json.dumps([counters["chunks"], loaded, before, blas_threads()]))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          check=False, env=env)
    assert proc.returncode == 0, proc.stderr
    chunks, loaded, before, after = json.loads(proc.stdout.strip().splitlines()[-1])
    assert chunks == 70 and loaded == []
    assert after == (None if before is None else 1), (before, after)  # None: no BLAS loaded
