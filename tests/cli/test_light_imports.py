"""The ``shardreplay`` command and ``train``'s launcher import neither torch nor numba: a
launch pays for them once per learner (and actor), not once more in the process that
starts them (2.4 and 4 CPU-seconds on this machine)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from shardreplay.runtime.algos import ACTIONS, algorithm, spec_of
from shardreplay.runtime.envs import describe_env, env_source

LAUNCHER_PATH = textwrap.dedent("""
    import sys
    from shardreplay.cli.main import build_parser
    build_parser()  # every subcommand's module
    from shardreplay.runtime.launch import launcher
    from shardreplay.runtime.settings import settings_for_resume
    from shardreplay.runtime.algos import ACTIONS, spec_of
    from shardreplay.runtime.envs import describe_env, env_source
    from shardreplay.checkpoint import latest_complete, list_checkpoints, checkpoint_dir
    from shardreplay.runtime.routing import chunk_bytes
    chunk_bytes(spec_of("dqn", describe_env(env_source("CartPole-v1"), ACTIONS["dqn"])), 4, 32)
    print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numba")))
""")


def test_the_cli_and_the_launcher_import_neither_torch_nor_numba() -> None:
    out = subprocess.run([sys.executable, "-c", LAUNCHER_PATH], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("name", "env_id"), [("dqn", "CartPole-v1"), ("sac", "Pendulum-v1"),
                                             ("r2d2", "CartPole-v1")])
def test_the_launchers_spec_is_the_algorithms(name: str, env_id: str) -> None:
    env = describe_env(env_source(env_id), ACTIONS[name])
    assert spec_of(name, env, (32, 16)) == algorithm(name).transition_spec(env, (32, 16))
