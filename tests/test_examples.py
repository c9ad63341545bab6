"""Smoke tests of the examples: each runs in a subprocess with a time limit."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, *args: str, timeout_s: float = 60.0) -> str:
    """Run an example to completion (subprocess.run kills it on timeout); return its stdout."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def number(pattern: str, text: str) -> float:
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"no line matching {pattern!r} in:\n{text}"
    return float(match.group(1))


@pytest.mark.slow
def test_prioritized_cartpole_default():
    out = run_example("prioritized_cartpole.py")
    assert number(r"^collected\s+(\d+) steps", out) >= 4000
    assert number(r"^num_steps\s+\d+ stored of capacity (\d+)", out) == 8 * 256
    assert number(r"^num_steps\s+(\d+) stored", out) == 8 * 256  # 4000 steps fill the rings
    assert 0 < number(r"^len\s+(\d+) valid windows of 4 steps", out) <= 8 * 256
    assert re.search(r"^batch\s+.*obs \(64, 4, 4\) float32", out, re.MULTILINE)
    assert number(r"^priorities\s+(\d+) updated over 20 batches", out) == 20 * 64
    assert number(r"^weights \(last\)\s+.*max\s+(\S+)", out) <= 1.0
    assert number(r"^bootstrap discount\s+.*max\s+(\S+)", out) == pytest.approx(0.99**3, abs=1e-4)
    assert number(r"^3-step returns\s+.*max\s+(\S+)", out) == pytest.approx(1 + 0.99 + 0.99**2, abs=1e-3)
    assert out.rstrip().endswith("done")


@pytest.mark.slow  # fresh interpreters or many examples: 20-100 s at load ~9 on 2 cores
def test_prioritized_cartpole_tiny_one_step():
    out = run_example("prioritized_cartpole.py", "--num-envs", "2", "--env-steps", "300",
                      "--n-step", "1", "--batch-size", "8", "--num-batches", "2")
    assert number(r"^collected\s+(\d+) steps", out) >= 300
    assert number(r"^len\s+\d+ valid windows of (\d+) steps", out) == 2
    assert number(r"^1-step returns\s+.*min\s+(\S+)", out) == 1.0  # CartPole pays 1 per step
    assert out.rstrip().endswith("done")


CLEANRL_SHORT = ("--total-timesteps", "6000", "--learning-starts", "500", "--train-frequency", "2",
                 "--target-network-frequency", "200", "--learning-rate", "1e-3",
                 "--exploration-fraction", "0.4", "--eval-episodes", "5")


@pytest.mark.slow
@pytest.mark.parametrize("replay", ["uniform", "prioritized"])
def test_cleanrl_dqn_port_learns_cartpole(replay):
    """6,000 steps of CleanRL's loop on shardreplay: a random policy scores ~22 on CartPole;
    the greedy policy learnt (fixed seed, one torch thread: deterministic) scores far more."""
    extra = ("--prioritized",) if replay == "prioritized" else ()
    out = run_example("cleanrl_dqn.py", *CLEANRL_SHORT, *extra, timeout_s=300)
    assert re.search(rf"^replay\s+{replay}$", out, re.MULTILINE)
    assert number(r"^stored_steps\s+(\S+)", out) == 6000
    assert number(r"^gradient_steps\s+(\S+)", out) == len(range(502, 6000, 2))
    assert number(r"^eval_return\s+(\S+)", out) >= 100
    assert number(r"^last_returns\s+(\S+)", out) >= 3 * number(r"^first_returns\s+(\S+)", out)
    assert out.rstrip().endswith("done")


@pytest.mark.slow
def test_cleanrl_sac_port_runs_a_tiny_budget():
    """400 steps of CleanRL's SAC loop on shardreplay with prioritized replay: every step
    stored, one critic step per step after learning starts, the temperature tuned
    (about 12 s of CPU; minutes of wall time at load 50 on 2 cores)."""
    out = run_example("cleanrl_sac.py", "--total-timesteps", "400", "--learning-starts", "300",
                      "--batch-size", "32", "--eval-episodes", "1", "--prioritized", timeout_s=600)
    assert re.search(r"^replay\s+prioritized$", out, re.MULTILINE)
    assert number(r"^stored_steps\s+(\S+)", out) == 400
    # Pendulum's episodes are 200 steps; the autoreset takes the 201st: the 2nd ends at 401
    assert number(r"^episodes\s+(\S+)", out) == 1
    assert number(r"^gradient_steps\s+(\S+)", out) == len(range(301, 400))
    assert 0 < number(r"^alpha\s+(\S+)", out) < 1  # autotuned down from 1
    assert -2000 < number(r"^eval_return\s+(\S+)", out) <= 0
    assert out.rstrip().endswith("done")


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_sac_ranks_end_with_equal_networks():
    """examples/ddp_sac.py on 2 gloo ranks (torchrun), a tiny budget: both ranks end with
    the same checksum of policy, critics, targets and temperature."""
    from tests.support import child_env, torchrun

    cmd = torchrun(2, str(EXAMPLES / "ddp_sac.py"), "--steps", "200", "--learning-starts", "100",
                   "--batch-size", "16", "--hidden", "16", "--log-every", "100")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, env=child_env())
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    summary = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert summary["world_size"] == 2 and summary["updates"] >= 100
    first, second = summary["checksums"]
    assert first == second
    assert summary["replay_steps"] == 2 * 2 * 200  # 2 ranks x 2 envs x 200 steps
    assert proc.stdout.rstrip().endswith("done")


@pytest.mark.slow  # a fresh interpreter importing torchrl: about 10 s of CPU
def test_torchrl_dqn_loss_tiny():
    pytest.importorskip("torchrl")
    out = run_example("torchrl_dqn_loss.py", "--frames", "400", "--frames-per-batch", "200",
                      "--updates-per-batch", "2", "--batch-size", "32", timeout_s=300)
    episodes = number(r"^collected\s+400 transitions, (\d+) episodes ended", out)
    assert episodes >= 5  # random CartPole episodes last about 20 steps
    assert number(r"^stored\s+(\d+) steps", out) == 400 + episodes  # one LAST step per episode end
    assert re.search(r"^losses\s+.*all finite True", out, re.MULTILINE)
    assert number(r"^priorities\s+(\d+) updated over 4 batches", out) == 4 * 32
    assert number(r"^steps_to_next_obs max (\d+)", out) == 3

@pytest.mark.slow  # a tiny budget: imports and a few dozen learner steps (20-90 s on a loaded machine)
def test_r2d2_cartpole_tiny_budget():
    out = run_example("r2d2_cartpole.py", "--num-envs", "4", "--total-env-steps", "800",
                      "--learning-starts", "400", "--eval-every", "800", "--eval-episodes", "2",
                      "--stream-capacity", "400", "--seq-len", "12", "--period", "6", "--burn-in", "4",
                      "--batch-size", "8", timeout_s=300)
    assert "period=6" in out
    assert number(r"^env_steps\s+(\d+)", out) == 800
    assert number(r"^updates\s+(\d+)", out) == 101  # one per 4-env step from 400 to 800 env steps
    assert number(r"^sequences\s+(\d+) drawable", out) > 0
    assert number(r"^eval\s+env_steps 800 .* return (\S+)", out) >= 8  # CartPole lasts >= 8 steps
    assert out.rstrip().endswith("done")
