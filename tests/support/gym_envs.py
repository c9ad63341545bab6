"""Small gymnasium environments that tests register by importing a module (what
``train --env-import`` does): written to a directory the test puts on the path."""

from __future__ import annotations

from pathlib import Path

BLINK_SOURCE = '''"""Blink-v0: a 12x12 RGB image env (channels last); reward 1 when the action names
the lit edge (0: top, 1: bottom), a new edge each step; episodes of ``length`` steps."""
import gymnasium as gym
import numpy as np


class Blink(gym.Env):
    """See the module docstring."""

    observation_space = gym.spaces.Box(0, 255, (12, 12, 3), np.uint8)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, length=20):
        self.length = length

    def _obs(self):
        o = np.zeros((12, 12, 3), np.uint8)
        o[0 if self.side == 0 else 11, :, :] = 255
        return o

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.side = 0, int(self.np_random.integers(2))
        return self._obs(), {}

    def step(self, action):
        r = float(action == self.side)
        self.t += 1
        self.side = int(self.np_random.integers(2))
        return self._obs(), r, False, self.t >= self.length, {}


gym.register("Blink-v0", entry_point=Blink)
'''


def write_blink_env(directory: Path) -> str:
    """Write the module that registers ``Blink-v0`` into ``directory``; its name."""
    (directory / "blink_env.py").write_text(BLINK_SOURCE)
    return "blink_env"
