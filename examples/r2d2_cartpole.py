"""R2D2 on partially observable CartPole (velocities hidden), on shardreplay sequences.

CartPole with only ``[x, theta]`` observed (``shardreplay.gym.pomdp``) cannot be solved by
a feed-forward Q-network: the policy must remember. This is R2D2 (Kapturowski et al.
2019) at CartPole scale, in one process:

* an LSTM Q-network acts in ``num_envs`` envs with Ape-X's per-env epsilons, and writes
  every step with the recurrent state ``(h, c)`` it held there (spec fields ``h``, ``c``);
* a prioritized :class:`shardreplay.ReplayBuffer` with ``window=seq_len`` and
  ``period=period`` draws sequences that start every ``period`` steps of an episode
  (overlapping by ``seq_len - period``);
* the learner starts its network from the stored state at each sequence's first step,
  unrolls ``burn_in`` steps without loss, and learns double-Q ``n_step`` targets on the
  rest (:func:`shardreplay.sample_sequences`, ``learn_mask``); it sets each sequence's
  priority to ``0.9 max |delta| + 0.1 mean |delta|`` (:func:`shardreplay.sequence_priorities`).

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
import torch.nn.functional as F
from torch import nn

from shardreplay import Field, ReplayBuffer, Spec, StepType, sample_sequences, sequence_priorities
from shardreplay.gym.pomdp import make_masked_cartpole


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


class RecurrentQ(nn.Module):
    """Observation -> ReLU layer -> LSTM -> Q-values, unrolled over ``[B, T]``."""

    def __init__(self, obs_dim: int, num_actions: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Linear(obs_dim, hidden)
        self.lstm = nn.LSTM(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, num_actions)

    def forward(self, obs: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Q-values ``[B, T, A]`` and the final state, for ``obs`` ``[B, T, obs_dim]`` from
        ``state`` ``([B, H], [B, H])``."""
        out, (h, c) = self.lstm(F.relu(self.embed(obs)), (state[0][None], state[1][None]))
        return self.head(out), (h[0], c[0])


def ape_x_epsilons(n: int) -> np.ndarray:
    """Ape-X's fixed per-actor epsilons ``0.4 ** (1 + 7 i / (n - 1))``."""
    return 0.4 ** (1 + 7 * np.arange(n) / max(n - 1, 1))


def make_buffer(s: Settings, hidden: int) -> ReplayBuffer:
    """The sequence buffer: obs, action, reward and the actor's LSTM state per step."""
    spec = Spec({"obs": Field((2,), np.float32), "action": Field((), np.int64),
                 "reward": Field((), np.float32), "h": Field((hidden,), np.float32),
                 "c": Field((hidden,), np.float32)})
    return ReplayBuffer(spec, num_streams=s.num_envs, stream_capacity=s.stream_capacity, window=s.seq_len,
                        period=s.period, sampler="prioritized", alpha=s.alpha, beta=s.beta, seed=s.seed)


def nstep_targets(s: Settings, data: dict[str, torch.Tensor], mask: torch.Tensor, q_online: torch.Tensor,
                  q_target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Double-Q n-step targets for positions ``0 .. L-n-1`` and which of them count.

    Returns ``G_t + gamma^m d_{t+m} Q_target(o_{t+m}, argmax_a Q_online(o_{t+m}, a))`` with
    ``m = min(n, steps to the episode's LAST)`` (dm_env: the LAST step's discount is 0
    after a termination, 1 after a truncation) and the positions that are stored steps
    with an action (not LAST, not padding).
    """
    n, length = s.n_step, mask.shape[1]
    span = length - n
    reward, discount = data["reward"], data["discount"]
    is_last = (data["step_type"] == StepType.LAST) & mask
    ret = torch.zeros(mask.shape[0], span)
    scale = torch.ones(mask.shape[0], span)
    ended = torch.zeros(mask.shape[0], span, dtype=torch.bool)
    boot = torch.full((mask.shape[0], span), n, dtype=torch.long) + torch.arange(span)
    boot_scale = torch.zeros(mask.shape[0], span)
    for k in range(n):
        ret = ret + torch.where(ended, 0.0, scale * reward[:, k:k + span])
        scale = torch.where(ended, scale, scale * s.gamma)
        last_next = is_last[:, k + 1:k + 1 + span] & ~ended
        boot = torch.where(last_next, torch.arange(span) + k + 1, boot)
        boot_scale = torch.where(last_next, scale * discount[:, k + 1:k + 1 + span], boot_scale)
        ended = ended | last_next
    boot_scale = torch.where(ended, boot_scale, scale * discount.gather(1, boot))
    best = q_online.gather(1, boot[..., None].expand(-1, -1, q_online.shape[-1])).argmax(-1)
    q_next = q_target.gather(1, boot[..., None].expand(-1, -1, q_target.shape[-1]))
    q_next = q_next.gather(2, best[..., None])[..., 0]
    counts = mask[:, :span] & (data["step_type"][:, :span] != StepType.LAST)
    return ret + boot_scale * q_next, counts


def learn(s: Settings, buffer: ReplayBuffer, online: RecurrentQ, target: RecurrentQ,
          optimizer: torch.optim.Optimizer) -> float:
    """One R2D2 learner step; returns the loss."""
    seq = sample_sequences(buffer, s.batch_size, burn_in=s.burn_in, state=("h", "c"))
    data, mask = seq.batch.data, seq.batch.mask
    obs = data["obs"]
    start = (seq.start_state["h"], seq.start_state["c"])
    with torch.no_grad():
        _q, burned = online(obs[:, :s.burn_in], start) if s.burn_in else (None, start)
        q_tgt, _ = target(obs, start)
    q_learn, _ = online(obs[:, s.burn_in:], burned)
    # Positions before burn_in get no loss: their online Q is a placeholder (no gradient).
    q_on = torch.cat([q_learn.new_zeros(obs.shape[0], s.burn_in, q_learn.shape[-1]), q_learn], dim=1)
    with torch.no_grad():
        targets, counts = nstep_targets(s, data, mask, q_on.detach(), q_tgt)
    span = targets.shape[1]
    learn_here = seq.learn_mask[:, :span] & counts
    q_taken = q_on[:, :span].gather(2, data["action"][:, :span, None])[..., 0]
    td = q_taken - targets
    per_step = F.smooth_l1_loss(q_taken, targets, reduction="none") * learn_here
    per_seq = per_step.sum(1) / learn_here.sum(1).clamp(min=1)
    loss = (seq.weights * per_seq).mean()
    optimizer.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(online.parameters(), 10.0)
    optimizer.step()
    priorities = sequence_priorities(td.detach(), learn_here) + 1e-3
    buffer.update_priorities(seq.keys, priorities)
    return float(loss.detach())


def evaluate(s: Settings, net: RecurrentQ, episodes: int, seed: int) -> float:
    """Mean return of ``episodes`` greedy episodes, run side by side."""
    envs = gym.vector.SyncVectorEnv([make_masked_cartpole for _ in range(episodes)])
    try:
        obs, _ = envs.reset(seed=seed)
        h = torch.zeros(episodes, s.hidden)
        c = torch.zeros(episodes, s.hidden)
        total = np.zeros(episodes)
        running = np.ones(episodes, bool)
        while running.any():
            with torch.no_grad():
                q, (h, c) = net(torch.as_tensor(obs)[:, None], (h, c))
            obs, reward, term, trunc, _ = envs.step(q[:, 0].argmax(-1).numpy())
            total += reward * running
            running &= ~(term | trunc)
    finally:
        envs.close()
    return float(total.mean())


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
    eps = ape_x_epsilons(s.num_envs)
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
                last_eval = evaluate(s, online, s.eval_episodes, seed=s.seed + 10_000 + env_steps)
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
