"""``shardreplay actor``: run one actor against a remote learner (Redis or a shared spool).

Stops cleanly on SIGTERM / SIGINT (sending what it holds); exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys
from typing import Any

from shardreplay.errors import ShardReplayError
from shardreplay.runtime.actor import ActorSettings

# "name: text" lines of the ActorSettings docstring, for --help.
_HELP = {name: " ".join(text.split()) for names, text in
         re.findall(r"^\s{8}(\w+(?:, \w+)*): (.+?)(?=\n\s{8}\w+(?:, \w+)*:|\n\s*$)",
                    ActorSettings.__doc__ or "", flags=re.M | re.S)
         for name in names.split(", ")}


def add_parser(subparsers: Any) -> None:
    """Register ``actor`` on an argparse subparsers object."""
    p = subparsers.add_parser("actor", help="run one actor (environments + policy) for a learner",
                              description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = {f.name: f.default for f in dataclasses.fields(ActorSettings)}
    p.add_argument("--actor-id", type=int, required=True, help="this actor's id, 0 .. num-actors-1")
    p.add_argument("--num-actors", type=int, required=True, help="actors in the run")
    p.add_argument("--num-shards", type=int, required=True, help="learner ranks (replay shards)")
    p.add_argument("--transport", required=True, help="file:///dir or redis://host:port/db")
    p.add_argument("--policy-url", required=True, help="where the learner publishes weights")
    for name in ("env_id", "envs_per_actor", "chunk_steps", "epsilon_base", "epsilon_exponent",
                 "epsilon_warmup_steps", "max_env_steps", "policy_wait_s", "seed", "queued_per_actor",
                 "policy_check_interval_s"):
        default = defaults[name]
        kind = int if name in ("max_env_steps", "seed", "queued_per_actor") else type(default)
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=_HELP.get(name))
    p.add_argument("--delivery-log", default=None, metavar="FILE", help=_HELP.get("delivery_log"))
    p.add_argument("--hidden", type=int, nargs="+", default=list(defaults["hidden"]),
                   help="hidden layer sizes (only a fallback: the published policy's shape is used)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``actor``; returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from shardreplay.runtime.actor import run as run_actor

    names = {f.name for f in dataclasses.fields(ActorSettings)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["hidden"] = tuple(values["hidden"])
    try:
        counters = run_actor(ActorSettings(**values))
    except ShardReplayError as exc:
        print(f"shardreplay actor: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(counters))
    return 0
