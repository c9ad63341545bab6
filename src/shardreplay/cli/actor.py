"""``shardreplay actor``: run one actor against a remote learner (Redis or a shared spool).

Only ``--actor-id`` and ``--policy-url`` are needed: the run's settings that every
actor must share with the learners (chunk size, envs per actor, environment, queue
bound, epsilon schedule, number of actors and shards) and its transport come with the
learner's policy. A flag that contradicts the learner's value ends the actor with one
line (exit 2). Stops cleanly on SIGTERM / SIGINT (sending what it holds); exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Any

from shardreplay.cli import field_help, plain
from shardreplay.cli.train_flags import settings_help
from shardreplay.errors import ConfigError, ShardReplayError
from shardreplay.runtime.actor.settings import AGREED, ActorSettings
from shardreplay.runtime.log_lines import configure_logging
from shardreplay.secrets import adopt, mask, read_password_file
from shardreplay.transport.urls import parse_medium

_HELP = {**settings_help(), **field_help(ActorSettings)}  # the agreed settings as train has them


def add_parser(subparsers: Any) -> None:
    """Register ``actor`` on an argparse subparsers object."""
    p = subparsers.add_parser("actor", help="run one actor (environments + policy) for a learner",
                              description=plain(__doc__),
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = {f.name: f.default for f in dataclasses.fields(ActorSettings)}
    p.add_argument("--actor-id", type=int, required=True, help="this actor's id, 0 .. num-actors-1")
    p.add_argument("--policy-url", required=True, help="where the learner publishes weights")
    p.add_argument("--transport", default="",
                   help="file:///dir or redis://host:port/db ('' = the learner's, as it published it; give "
                        "it where this machine reaches the medium at another address). Not local: that "
                        "transport exists only inside shardreplay train")
    for name in (*AGREED, "max_env_steps", "policy_wait_s", "seed", "policy_check_interval_s"):
        default = defaults[name]
        kind = {"int": int, "float": float}.get(ActorSettings.__annotations__[name].split(" |")[0], str)
        text = _HELP.get(name, "")
        if name in AGREED:
            # "%(default).0s" prints nothing; it keeps argparse from adding "(default: None)".
            text += " (default: the learner's; another value is an error)%(default).0s"
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=text)
    p.add_argument("--device", default="cpu", help="where this actor runs its network: cpu, cuda or cuda:N")
    p.add_argument("--delivery-log", default=None, metavar="FILE", help=_HELP.get("delivery_log"))
    p.add_argument("--redis-password-file", metavar="FILE", default=None,
                   help="read the Redis password from FILE's first line (or set SHARDREPLAY_REDIS_PASSWORD, "
                        "or give it in the URL: it is then masked in everything printed)")
    p.add_argument("--hidden", type=int, nargs="+", default=list(ActorSettings.hidden),
                   help="hidden layer sizes (only a fallback: the published policy's shape is used)")
    p.set_defaults(func=run)


def _check_media(args: argparse.Namespace) -> None:
    """Refuse what could only wait forever: the local transport (it exists only inside
    ``shardreplay train``, for the actors it starts) and a Redis server that does not answer.

    Raises:
        ConfigError: ``--transport local``.
        TransportError: a Redis URL whose server does not answer within 5 s.
    """
    from shardreplay.runtime.routing import check_reachable

    if args.transport and parse_medium(args.transport).kind == "local":
        raise ConfigError("--transport local: the local transport exists only inside shardreplay train "
                          "(for the actors it starts); give file:///shared/dir or redis://host:port/db")
    for url in {args.transport, args.policy_url}:
        check_reachable(url)


def run(args: argparse.Namespace) -> int:
    """Run ``actor``; returns the exit code."""
    configure_logging(logging.INFO, "%(asctime)s %(name)s: %(message)s")  # masks the Redis password
    from shardreplay.runtime.actor.loop import run as run_actor

    names = {f.name for f in dataclasses.fields(ActorSettings)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["hidden"] = tuple(values["hidden"])
    try:
        if args.redis_password_file:
            read_password_file(args.redis_password_file)
        values["policy_url"], values["transport"] = adopt(args.policy_url), adopt(args.transport)
        _check_media(args)
        counters = run_actor(ActorSettings(**values))
    except ShardReplayError as exc:
        print(mask(f"shardreplay actor: {exc}"), file=sys.stderr)
        return 2
    print(json.dumps(counters))
    return 0
