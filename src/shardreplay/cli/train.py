"""``shardreplay train``: distributed Ape-X DQN with sharded prioritized replay.

Every TrainSettings field is a flag (``--env-id``, ``--learners``, ...); ``--config``
reads a YAML file of the same fields (flags given on the command line win).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from shardreplay.errors import ConfigError, ShardReplayError
from shardreplay.runtime.settings import TrainSettings

_HELP = dict(re.findall(r"^\s{8}(\w+): (.+?)(?=\n\s{8}\w+:|\n\s*$)",
                        TrainSettings.__doc__ or "", flags=re.M | re.S))


def _help(name: str) -> str:
    for key, text in _HELP.items():
        if name == key or name in key.split(", "):
            return " ".join(text.split())
    return ""


def add_parser(subparsers: Any) -> None:
    """Register ``train`` on an argparse subparsers object."""
    p = subparsers.add_parser("train", help="train distributed Ape-X DQN (default: CartPole-v1)",
                              description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", type=Path, help="YAML file of settings (same names as the flags)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR",
                   help="continue RUN_DIR from its newest complete checkpoint (flags override its config)")
    p.add_argument("--auto-resume", action="store_true",
                   help="continue --run-dir from its newest complete checkpoint, else start it "
                        "afresh (incomplete checkpoints are moved to checkpoints/incomplete/): one "
                        "command for a job that a scheduler may restart")
    defaults = TrainSettings()
    for f in dataclasses.fields(TrainSettings):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name)
        if isinstance(value, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=_help(f.name))
        elif isinstance(value, tuple):
            p.add_argument(flag, type=int, nargs="+", default=None, help=_help(f.name))
        else:
            p.add_argument(flag, type=type(value), default=None, help=f"{_help(f.name)} [{value}]")
    p.set_defaults(func=run)


def _settings(args: argparse.Namespace) -> tuple[TrainSettings, bool]:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainSettings)
             if f.name != "extra" and getattr(args, f.name, None) is not None}
    if args.resume is not None:
        _check_resumable(args.resume)
    resume_dir = args.resume or _resumable(args)
    if resume_dir is not None:
        from shardreplay.runtime.learner import settings_for_resume

        return settings_for_resume(resume_dir, given), True
    base: dict[str, Any] = {}
    if args.config is not None:
        import yaml

        base = yaml.safe_load(args.config.read_text()) or {}
    base.update(given)
    return TrainSettings.from_dict(base), False


def _check_resumable(run_dir: Path) -> None:
    """``--resume``: refuse, before any process starts, a run directory without a
    complete checkpoint.

    Raises:
        IncompleteCheckpointError: no complete checkpoint (the message says what to do).
    """
    from shardreplay.checkpoint import latest_complete, list_checkpoints
    from shardreplay.errors import IncompleteCheckpointError

    root = Path(run_dir) / "checkpoints"
    if latest_complete(root) is not None:
        return
    if not list_checkpoints(root):
        raise IncompleteCheckpointError(f"--resume {run_dir}: no checkpoint under {root}; start the run "
                                        f"with --run-dir {run_dir} (or --auto-resume)")
    raise IncompleteCheckpointError(
        f"--resume {run_dir}: no complete checkpoint under {root}, only incomplete ones (a run stopped "
        f"before every rank saved): start it again with --run-dir {run_dir} --auto-resume (which sets "
        "them aside and starts afresh), or use another --run-dir")


def _resumable(args: argparse.Namespace) -> Path | None:
    """``--auto-resume``: the run directory when it holds a complete checkpoint (then the
    run continues from the newest one), else None (the run starts afresh; incomplete
    checkpoints are set aside by the launcher).

    Checkpoints appear only once every learner rank runs, so under torchrun all ranks
    see the same answer here, before they meet.
    """
    if not args.auto_resume:
        return None
    if not args.run_dir:
        raise ConfigError("--auto-resume needs --run-dir (the directory to continue or start)")
    from shardreplay.checkpoint import latest_complete

    run_dir = Path(args.run_dir)
    if (run_dir / "config.json").exists() and latest_complete(run_dir / "checkpoints") is not None:
        return run_dir
    return None


def run(args: argparse.Namespace) -> int:
    """Run ``train``; returns the exit code (a rank under torchrun exits here instead)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from shardreplay.runtime.launch import under_torchrun

    code = _run(args)
    if under_torchrun():
        # torch 2.13's gloo threads can abort the interpreter at exit after the group was
        # destroyed (pytorch#190489; seen here as SIGABRT "terminate called without an
        # active exception" on a rank that finished first): flush, then leave directly,
        # as the spawned learner ranks do.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run(args: argparse.Namespace) -> int:
    try:
        settings, resume = _settings(args)
        from shardreplay.runtime.launch import train

        summary = train(settings, resume, auto_resume=bool(args.auto_resume))
    except ShardReplayError as exc:
        print(f"shardreplay train: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the launcher took over the signal
        print("shardreplay train: interrupted before training started", file=sys.stderr)
        return 130
    print(json.dumps(summary, indent=1))
    return 0
