"""Environment kinds for train: vectors, Atari stacks, MinAtar images, registered by import."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from shardreplay.errors import ConfigError
from shardreplay.runtime.actor.settings import actor_seed
from shardreplay.runtime.algos.networks import (
    MinAtarQNetwork,
    NatureQNetwork,
    QNetwork,
    choose_network,
    make_q_network,
)
from shardreplay.runtime.envs import EnvSource, describe_env, env_source, make_vector_env
from tests.support.gym_envs import write_blink_env


@pytest.fixture
def pixel_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module that registers ``Blink-v0`` when imported (what ``--env-import`` names)."""
    module = write_blink_env(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield module
    sys.modules.pop("blink_env", None)
    import gymnasium

    gymnasium.registry.pop("Blink-v0", None)  # the next import registers it afresh, no warning


@pytest.mark.parametrize(("shape", "auto"), [((4,), "mlp"), ((4, 84, 84), "nature"), ((3, 36, 40), "nature"),
                                              ((4, 10, 10), "minatar"), ((7, 35, 90), "minatar")])
def test_network_follows_the_observation(shape: tuple[int, ...], auto: str) -> None:
    assert choose_network(shape) == auto
    net = make_q_network(shape, 5, hidden=(8,))
    dtype = torch.float32 if auto == "mlp" else torch.uint8  # what the actors feed each kind
    assert net(torch.zeros(3, *shape, dtype=dtype)).shape == (3, 5)
    assert isinstance(net, {"mlp": QNetwork, "nature": NatureQNetwork, "minatar": MinAtarQNetwork}[auto])


@pytest.mark.parametrize(("shape", "network"), [((4,), "nature"), ((4, 10, 10), "nature"),
                                                 ((4, 84, 84), "mlp"), ((2, 3), "auto"), ((4,), "resnet")])
def test_networks_that_cannot_take_the_observations_are_refused(shape: tuple[int, ...], network: str) -> None:
    with pytest.raises(ConfigError, match=r"network|observations"):
        choose_network(shape, network)


def test_vector_env() -> None:
    info = describe_env(EnvSource("CartPole-v1"))
    assert (info.obs_shape, info.obs_dtype, info.num_actions, info.frame_stack) == ((4,), np.float32, 2, 0)


def test_env_import_registers_a_pixel_env_made_channels_first(pixel_module: str) -> None:
    source = EnvSource("Blink-v0", (pixel_module,), {"length": 5})
    info = describe_env(source)
    assert (info.obs_shape, info.obs_dtype, info.frame_stack) == ((3, 12, 12), np.uint8, 0)
    env, obs = make_vector_env(source, 2, seed=0)
    try:
        assert obs.shape == (2, 3, 12, 12) and obs.dtype == np.uint8
        lit = obs[:, 0, [0, 11], 0]  # the lit edge, as seen channels first
        assert set(map(tuple, lit.tolist())) <= {(255, 0), (0, 255)}
        for _ in range(5):
            *_, trunc, _ = env.step(np.zeros(2, np.int64))
        assert trunc.all()  # the kwargs reached the env: episodes of 5 steps
    finally:
        env.close()


def test_unknown_ids_modules_and_kwargs_are_config_errors(pixel_module: str) -> None:
    with pytest.raises(ConfigError, match="unknown gymnasium environment"):
        describe_env(EnvSource("Nope-v0"))
    with pytest.raises(ConfigError, match="cannot import no_such_module"):
        describe_env(EnvSource("Blink-v0", ("no_such_module",)))
    with pytest.raises(ConfigError, match="bad --env-kwargs"):
        describe_env(EnvSource("Blink-v0", (pixel_module,), {"colour": "red"}))
    with pytest.raises(ConfigError, match="JSON object"):
        env_source("Blink-v0", pixel_module, "[1, 2]")
    with pytest.raises(ConfigError, match="Discrete"):
        describe_env(EnvSource("Pendulum-v1"))


def test_minatar_images_are_channels_first_uint8() -> None:
    pytest.importorskip("minatar")
    info = describe_env(EnvSource("MinAtar/Breakout-v1"))
    assert (info.obs_shape, info.obs_dtype, info.num_actions) == ((4, 10, 10), np.uint8, 3)
    assert choose_network(info.obs_shape) == "minatar"


def test_the_actor_seed_of_a_resumed_run_is_one_minatar_takes() -> None:
    """A run resumed after 41,011 env steps seeded its actors past 2**32, which MinAtar's
    numpy RandomState refuses: every actor died at its start, and the learner trained on
    no new steps."""
    pytest.importorskip("minatar")
    seed = actor_seed(0, 1, 150_144)
    assert 0 <= seed < 2**32
    assert seed != actor_seed(0, 1, 150_176)  # a later resume still plays new episodes
    env, obs = make_vector_env(EnvSource("MinAtar/Breakout-v1"), 2, seed)
    env.close()
    assert obs.shape == (2, 4, 10, 10)


def test_atari_is_preprocessed_and_stacked() -> None:
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    source = EnvSource("ALE/Pong-v5")
    info = describe_env(source)
    assert (info.obs_shape, info.frame_stack, info.num_actions) == ((4, 84, 84), 4, 6)
    env, obs = make_vector_env(source, 1, seed=0)
    try:
        assert (obs[0, 0] == obs[0, 3]).all()  # a reset stack repeats the reset frame
        nxt, *_ = env.step(np.zeros(1, np.int64))
        assert (nxt[0, :3] == obs[0, 1:]).all()  # oldest first: the stack shifts by one frame
    finally:
        env.close()
