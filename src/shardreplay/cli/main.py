"""The ``shardreplay`` command: one subcommand per module of this package.

Adding a subcommand is one line in ``_SUBCOMMANDS``: a module with
``add_parser(subparsers)`` that sets ``func`` (returning the exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from shardreplay import _signals

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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardreplay`` console script; returns the exit code.

    Ctrl-C and SIGTERM are recorded from here on, before the subcommands' imports
    (torch, numba: seconds): ``train`` stops at its own points, at any moment of its
    start-up (see :mod:`shardreplay._signals`); any other command gets the
    default handlers back, and a signal taken meanwhile then acts as it would have.
    """
    restore = _signals.take_over()
    try:
        args = build_parser().parse_args(argv)
        if args.command != "train":
            _signals.redeliver(restore)
            restore = None
        return int(args.func(args))
    finally:
        if restore is not None:
            restore()


if __name__ == "__main__":
    sys.exit(main())
