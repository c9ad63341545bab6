"""TorchRL's collector and DQNLoss around a prioritized shardreplay buffer, n-step.

What it does:

1. a TorchRL ``Collector`` steps CartPole-v1 (TorchRL's ``GymEnv``) and hands
   TensorDicts of transitions (``observation``, ``action``, ``("next", ...)``) straight to
   ``ReplayBuffer.extend`` (batch ``[T]`` made ``[1, T]``: one stream, time last); the
   buffer stores them as steps, episode ends included (docs/porting.md, "TorchRL");
2. ``sample(batch, as_tensordict=True, gamma=)`` returns n-step transitions with TorchRL's
   names, which TorchRL's ``DQNLoss`` takes unchanged (``steps_to_next_obs`` makes it
   discount the bootstrap by ``gamma ** m``);
3. the ``td_error`` the loss writes goes back as priorities:
   ``rb.update_priorities(td["index"], td["td_error"])``.

Needs ``pip install 'shardreplay[torchrl]'`` (torchrl, tensordict) and gymnasium.
Run: ``python examples/torchrl_dqn_loss.py`` (``--help`` lists the settings).
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
from torchrl.collectors import Collector
from torchrl.envs import GymEnv
from torchrl.modules import MLP, QValueActor
from torchrl.objectives import DQNLoss, SoftUpdate

from shardreplay import Field, ReplayBuffer, Spec


def main() -> None:
    """Collect, train a few DQN steps from the buffer, print what happened."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=2000, help="env steps to collect")
    parser.add_argument("--frames-per-batch", type=int, default=200, help="collector batch")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--updates-per-batch", type=int, default=8)
    parser.add_argument("--n-step", type=int, default=3)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    env = GymEnv("CartPole-v1", categorical_action_encoding=True)
    env.set_seed(args.seed)
    spec = Spec({"obs": Field((4,), np.float32), "action": Field((), np.int64),
                 "reward": Field((), np.float32)})
    rb = ReplayBuffer(spec, num_streams=1, stream_capacity=10_000, window=args.n_step + 1,
                      sampler="prioritized", alpha=0.6, beta=0.4, seed=args.seed)

    qnet = QValueActor(MLP(in_features=4, out_features=2, num_cells=[64, 64]), in_keys=["observation"],
                       spec=env.action_spec)
    loss = DQNLoss(qnet, action_space=env.action_spec, delay_value=True)
    loss.make_value_estimator(gamma=args.gamma)  # the gamma the buffer sums n-step returns with
    target = SoftUpdate(loss, eps=0.99)
    optim = torch.optim.Adam(loss.parameters(), lr=1e-3)

    collector = Collector(env, None, frames_per_batch=args.frames_per_batch,
                                  total_frames=args.frames)  # None: a random policy
    losses, updated, episodes = [], 0, 0
    for data in collector:
        episodes += int(data["next", "done"].sum())
        rb.extend(data.unsqueeze(0))  # [T] -> one stream of T consecutive transitions
        for _ in range(args.updates_per_batch):
            td = rb.sample(args.batch_size, as_tensordict=True, gamma=args.gamma)
            out = loss(td)
            optim.zero_grad()
            out["loss"].backward()
            optim.step()
            target.step()
            updated += rb.update_priorities(td["index"], td["td_error"])
            losses.append(float(out["loss"].detach()))
    collector.shutdown()

    last = rb.sample(args.batch_size, as_tensordict=True, gamma=args.gamma)
    print(f"collected {args.frames} transitions, {episodes} episodes ended")
    print(f"stored    {rb.num_steps} steps ({rb.num_steps - args.frames} LAST steps added)")
    print(f"losses    first {losses[0]:.4f} last {losses[-1]:.4f} all finite "
          f"{all(math.isfinite(x) for x in losses)}")
    print(f"priorities {updated} updated over {len(losses)} batches")
    print(f"steps_to_next_obs max {int(last['steps_to_next_obs'].max())} "
          f"terminated {int(last['next', 'terminated'].sum())} of {len(last)}")
    print("done")


if __name__ == "__main__":
    main()
