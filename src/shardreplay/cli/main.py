"""The ``shardreplay`` command: one subcommand per module of this package.

Adding a subcommand is one line in ``_SUBCOMMANDS``: a module with
``add_parser(subparsers)`` that sets ``func`` (returning the exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from shardreplay import _signals
from shardreplay.errors import ShardReplayError

_SUBCOMMANDS = (
    "shardreplay.cli.train",
    "shardreplay.cli.actor",
    "shardreplay.cli.checkpoint",
    "shardreplay.cli.evaluate",
    "shardreplay.cli.export",
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="shardreplay", description="Sharded, exact, prioritized replay "
                                     "for distributed RL on PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _SUBCOMMANDS:
        importlib.import_module(name).add_parser(sub)
    parser.set_defaults(command_parsers=sub.choices)  # whose usage an unknown flag shows
    return parser


def main(argv: list[str] | None = None, *, keep_stop_handlers: bool = False) -> int:
    """Run the ``shardreplay`` command ``argv`` (the console script runs it through
    :func:`console`); returns the exit code.

    Ctrl-C and SIGTERM are recorded from here on, before the subcommands' imports
    (torch, numba: seconds): ``train`` stops at its own points, at any moment of its
    start-up (see :mod:`shardreplay._signals`); any other command gets the
    default handlers back, and a signal taken meanwhile then acts as it would have. A
    :class:`ShardReplayError` (or a missing file) a command raises is one line
    ``error: ...`` on stderr, exit code 2. With ``keep_stop_handlers`` (:func:`console`),
    ``train``'s record of stop signals stays installed when it returns.
    """
    restore = _signals.take_over()
    try:
        args, unknown = build_parser().parse_known_args(argv)
        if unknown:  # the subcommand's usage, not the top level's
            args.command_parsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
        if args.command != "train":
            _signals.redeliver(restore)
            restore = None
        return int(args.func(args))
    except (ShardReplayError, FileNotFoundError) as exc:  # a command's refusal: one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if restore is not None and not keep_stop_handlers:
            restore()


def console() -> NoReturn:
    """The ``shardreplay`` console script and ``python -m shardreplay``: :func:`main`, then
    exit with its code. ``train``'s stop handlers stay until the process ends: put back,
    a stop signal that comes once the run has finished (its final line printed) would find
    the default action and kill the process in its exit, code -15 after a clean run."""
    sys.exit(main(keep_stop_handlers=True))


if __name__ == "__main__":
    console()
