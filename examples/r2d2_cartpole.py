"""R2D2 on partially observable CartPole (velocities hidden), on shardreplay sequences.

CartPole with only ``[x, theta]`` observed (``shardreplay.gym.pomdp``) cannot be solved by
a feed-forward Q-network: the policy must remember. This is R2D2 (Kapturowski et al.
2019) at CartPole scale, in one process:

* an LSTM Q-network acts in ``num_envs`` envs with Ape-X's per-env epsilons, and writes
  every step with the recurrent state ``(h, c)`` it held there (spec fields ``h``, ``c``,
  which the buffer keeps at the sequence starts only: ``Field(..., at_starts=True)``);
* a prioritized :class:`shardreplay.ReplayBuffer` with ``window=seq_len`` and
  ``period=period`` draws sequences that start every ``period`` steps of an episode
  (overlapping by ``seq_len - period``);
* the learner starts its network from the stored state at each sequence's first step,
  unrolls ``burn_in`` steps without loss, and learns double-Q ``n_step`` targets on the
  rest (:func:`shardreplay.sample_sequences`, ``learn_mask``; the network and the loss
  are ``shardreplay.runtime.algos.r2d2``'s, which ``shardreplay train --algo r2d2`` runs
  over many processes); it sets each sequence's priority to
  ``0.9 max |delta| + 0.1 mean |delta|`` (:func:`shardreplay.sequence_priorities`).

It stops when the mean return of ``eval_episodes`` greedy episodes reaches
``target_return``, or after ``time_limit_s`` / ``total_env_steps``.

Run: ``python examples/r2d2_cartpole.py`` (``--help`` lists the settings).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from shardreplay import Field, ReplayBuffer, Spec, StepType, sample_sequences, sequence_priorities
from shardreplay.gym.pomdp import ENV_ID, make_masked_cartpole
from shardreplay.runtime.algos.base import apex_epsilons
from shardreplay.runtime.algos.r2d2 import R2D2, RecurrentQ, sequence_loss
from shardreplay.runtime.policy_file import evaluate as evaluate_policy


@dataclass(frozen=True)
class Settings:
    """Settings of the run (each is also a flag, e.g. ``--total-env-steps 5000``)."""

    seed: int = 0
    """Seeds the envs, torch, the actors' exploration and the buffer."""
    num_envs: int = 8
    """Envs stepping together (one buffer stream each)."""
    total_env_steps: int = 400_000
    """Env steps at most."""
    time_limit_s: float = 900.0
    """Wall-clock limit of the run (evaluations included)."""
    target_return: float = 475.0
    """Stop once the mean greedy evaluation return reaches it."""
    stream_capacity: int = 10_000
    """Steps kept per stream."""
    seq_len: int = 16
    """Steps per sampled sequence (the window)."""
    period: int = 8
    """Steps between sequence starts in an episode (overlap = seq_len - period)."""
    burn_in: int = 4
    """Steps unrolled from the stored state without loss."""
    n_step: int = 5
    """n of the n-step double-Q targets."""
    gamma: float = 0.99
    """Discount factor."""
    hidden: int = 64
    """LSTM units."""
    batch_size: int = 32
    """Sequences per learner step."""
    learning_rate: float = 3e-3
    """Adam's learning rate."""
    learning_starts: int = 2_000
    """Env steps before the first learner step."""
    updates_per_iteration: int = 1
    """Learner steps per vector-env step (num_envs env steps)."""
    target_period: int = 100
    """Learner steps between hard target-network copies."""
    alpha: float = 0.9
    """Priority exponent (R2D2's 0.9)."""
    beta: float = 0.6
    """Importance-weight exponent."""
    eval_every: int = 6_000
    """Env steps between greedy evaluations."""
    eval_episodes: int = 10
    """Greedy episodes per evaluation."""


def parse_settings(argv: list[str] | None = None) -> Settings:
    """Settings from command-line flags (defaults from :class:`Settings`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(Settings):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    return Settings(**vars(parser.parse_args(argv)))


def make_buffer(s: Settings, hidden: int) -> ReplayBuffer:
    """The sequence buffer: obs, action, reward and the actor's LSTM state per step."""
    # h and c are kept at the sequence starts only (at_starts): the learner reads nothing else.
    state = Field((hidden,), np.float32, at_starts=True)
    spec = Spec({"obs": Field((2,), np.float32), "action": Field((), np.int64),
                 "reward": Field((), np.float32), "h": state, "c": state})
    return ReplayBuffer(spec, num_streams=s.num_envs, stream_capacity=s.stream_capacity, window=s.seq_len,
                        period=s.period, sampler="prioritized", alpha=s.alpha, beta=s.beta, seed=s.seed)


def learn(s: Settings, buffer: ReplayBuffer, online: RecurrentQ, target: RecurrentQ,
          optimizer: torch.optim.Optimizer) -> float:
    """One R2D2 learner step; returns the loss."""
    seq = sample_sequences(buffer, s.batch_size, burn_in=s.burn_in, state=("h", "c"))
    loss, td, learn_here = sequence_loss(online, target, seq, s.n_step, s.gamma)
    optimizer.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(online.parameters(), 10.0)
    optimizer.step()
    priorities = sequence_priorities(td, learn_here) + 1e-3
    buffer.update_priorities(seq.keys, priorities)
    return float(loss.detach())


def evaluate(net: RecurrentQ, episodes: int, seed: int) -> float:
    """Mean return of ``episodes`` greedy episodes, run side by side: the package's
    evaluation with R2D2's greedy actions (the LSTM unrolled over each episode from a
    zero state), as ``shardreplay train --algo r2d2`` and ``shardreplay evaluate`` run it."""
    return float(np.mean(evaluate_policy(R2D2.greedy(net), ENV_ID, episodes, seed=seed)))


def main(argv: list[str] | None = None) -> None:
    """Train until the target return, the time limit or the step budget; print the curve."""
    s = parse_settings(argv)
    torch.manual_seed(s.seed)
    torch.set_num_threads(1)
    rng = np.random.default_rng(s.seed)
    began = time.perf_counter()
    envs = gym.vector.SyncVectorEnv([make_masked_cartpole for _ in range(s.num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    online = RecurrentQ(2, 2, s.hidden)
    target = RecurrentQ(2, 2, s.hidden)
    target.load_state_dict(online.state_dict())
    optimizer = torch.optim.Adam(online.parameters(), lr=s.learning_rate, eps=1e-4)
    buffer = make_buffer(s, s.hidden)
    eps = apex_epsilons(s.num_envs, 0, s.num_envs)  # Ape-X's 0.4 ** (1 + 7 i / (n - 1))
    obs, _ = envs.reset(seed=s.seed)
    h = torch.zeros(s.num_envs, s.hidden)
    c = torch.zeros(s.num_envs, s.hidden)
    step_type = np.full(s.num_envs, StepType.FIRST, np.uint8)
    env_steps = updates = episodes = 0
    next_eval, best, last_eval, solved_at = s.eval_every, -1.0, -1.0, None
    print(f"buffer        {buffer!r}")
    try:
        while env_steps < s.total_env_steps and time.perf_counter() - began < s.time_limit_s:
            with torch.no_grad():
                q, (h2, c2) = online(torch.as_tensor(obs)[:, None], (h, c))
            greedy = q[:, 0].argmax(-1).numpy()
            explore = rng.random(s.num_envs) < eps
            action = np.where(explore, rng.integers(0, 2, s.num_envs), greedy)
            nxt, reward, term, trunc, info = envs.step(action)
            buffer.add({"obs": obs, "action": action, "reward": reward.astype(np.float32), "h": h.numpy(),
                        "c": c.numpy(), "step_type": step_type})
            done = term | trunc
            if done.any():  # the episode's LAST step: its final observation (same-step autoreset)
                ids = np.flatnonzero(done)
                final = np.stack([info["final_obs"][i] for i in ids]).astype(np.float32)
                buffer.add({"obs": final, "action": np.zeros(ids.shape[0], np.int64),
                            "reward": np.zeros(ids.shape[0], np.float32), "h": h2[ids].numpy(),
                            "c": c2[ids].numpy(), "step_type": np.full(ids.shape[0], StepType.LAST, np.uint8),
                            "discount": np.where(term[ids], 0.0, 1.0).astype(np.float32)}, stream_ids=ids)
                episodes += ids.shape[0]
            keep = torch.as_tensor(~done, dtype=torch.float32)[:, None]
            h, c = h2 * keep, c2 * keep  # a new episode starts from the zero state
            step_type = np.where(done, StepType.FIRST, StepType.MID).astype(np.uint8)
            obs = nxt
            env_steps += s.num_envs
            if env_steps >= s.learning_starts and len(buffer):
                for _ in range(s.updates_per_iteration):
                    learn(s, buffer, online, target, optimizer)
                    updates += 1
                    if updates % s.target_period == 0:
                        target.load_state_dict(online.state_dict())
            if env_steps >= next_eval:
                next_eval += s.eval_every
                last_eval = evaluate(online, s.eval_episodes, seed=s.seed + 10_000 + env_steps)
                best = max(best, last_eval)
                elapsed = time.perf_counter() - began
                print(f"eval          env_steps {env_steps} updates {updates} episodes {episodes} "
                      f"minutes {elapsed / 60:.2f} return {last_eval:.1f}", flush=True)
                if last_eval >= s.target_return:
                    solved_at = elapsed
                    break
    finally:
        envs.close()
    elapsed = time.perf_counter() - began
    print(f"sequences     {len(buffer)} drawable of {buffer.num_steps} stored steps "
          f"(window {s.seq_len}, period {s.period}, burn-in {s.burn_in})")
    print(f"env_steps     {env_steps}")
    print(f"updates       {updates}")
    print(f"best_eval     {best:.1f}")
    print(f"final_eval    {last_eval:.1f}")
    print(f"solved        {'yes' if solved_at is not None else 'no'} "
          f"(target {s.target_return:g}) after {elapsed:.1f} s")
    print("done")


if __name__ == "__main__":
    main()
