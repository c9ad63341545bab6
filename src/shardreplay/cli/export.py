"""``shardreplay export RUN --out policy.safetensors``: a run's policy network as one file.

The weights of the network actors act with (DQN's Q-network, SAC's tanh-Gaussian policy,
R2D2's recurrent Q-network), with the settings that rebuild it (``algo``, network kind,
observation shape, action count or Box bounds, hidden sizes, environment) and its origin
(updates, evaluation) in the safetensors metadata;
``shardreplay.runtime.policy_file.load_policy(path)`` rebuilds it.
``--which`` as for ``shardreplay evaluate``. Exit codes: 0 written, 2 no such run or policy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from shardreplay.cli import plain
from shardreplay.cli.evaluate import add_which, resolve_which
from shardreplay.errors import ShardReplayError


def add_parser(subparsers: Any) -> None:
    """Register ``export`` on argparse subparsers."""
    p = subparsers.add_parser("export", help="write a run's policy (weights + network) as .safetensors",
                              description=plain(__doc__),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, metavar="RUN", help="the run directory (--run-dir of train)")
    p.add_argument("--out", type=Path, required=True, help="the .safetensors file to write")
    add_which(p)
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    """``shardreplay export``; returns the exit code."""
    from shardreplay.runtime.policy_file import policy_of_run, save_policy

    which = resolve_which(args.run_dir, args.which)
    try:
        policy = policy_of_run(args.run_dir, which)
        save_policy(args.out, policy.net, policy.meta)
    except (ShardReplayError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(args.out), "which": which, **policy.described()}))
    return 0
