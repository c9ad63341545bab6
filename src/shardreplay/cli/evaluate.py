"""``shardreplay evaluate RUN``: greedy episodes of a run's policy, as one JSON line.

Any ``--algo``: DQN acts by argmax Q, SAC by its tanh-squashed mean action, R2D2 by argmax
Q with its LSTM unrolled over each episode from a zero state.

``--which best`` (the default when the run has one) takes ``RUN/best/policy.safetensors``,
the best evaluated policy so far; ``latest`` the newest complete checkpoint's network; a
number the checkpoint of that id. Exit codes: 0 done, 2 no such run or policy.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from shardreplay.cli import plain
from shardreplay.errors import ConfigError


def add_parser(subparsers: Any) -> None:
    """Register ``evaluate`` on argparse subparsers."""
    p = subparsers.add_parser("evaluate", help="greedy episodes of a run's best or a checkpoint's policy",
                              description=plain(__doc__),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, metavar="RUN", help="the run directory (--run-dir of train)")
    add_which(p)
    p.add_argument("--episodes", type=int, default=10, help="episodes to run (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first environment (default 0)")
    p.set_defaults(func=run_evaluate)


def add_which(p: argparse.ArgumentParser) -> None:
    """``--which`` (shared with ``export``)."""
    p.add_argument("--which", default=None, metavar="best|latest|ID",
                   help="best evaluated policy, newest complete checkpoint, or a checkpoint id "
                        "(default: best when the run has one, else latest)")


def resolve_which(run_dir: Path, which: str | None) -> str:
    """``which``, or ``best`` when the run has a best policy, else ``latest``."""
    from shardreplay.runtime.policy_file import best_path

    if which is not None:
        return which
    return "best" if best_path(run_dir).exists() else "latest"


def run_evaluate(args: argparse.Namespace) -> int:
    """``shardreplay evaluate``; returns the exit code.

    Raises:
        ShardReplayError: no such run or policy, or a bad flag (``main`` prints it, exit 2).
    """
    import numpy as np

    from shardreplay.runtime.policy_file import evaluate, policy_of_run

    if args.episodes < 1:
        raise ConfigError("--episodes must be >= 1")
    which = resolve_which(args.run_dir, args.which)
    policy = policy_of_run(args.run_dir, which)
    # Also makes the environment (its --env-import module may be missing here).
    returns = evaluate(policy.greedy(), policy.source, args.episodes, seed=args.seed)
    out = {"run_dir": str(args.run_dir), "which": which, "algo": policy.algo, "episodes": args.episodes,
           "mean_return": float(np.mean(returns)), "returns": returns,
           **{k: v for k, v in policy.described().items() if k in ("updates", "env_steps", "eval_return",
                                                                    "source")}}
    print(json.dumps(out))
    return 0
