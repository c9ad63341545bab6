"""The flags of ``shardreplay train``: one per setting of :class:`TrainSettings` (``--replay-capacity``
sets ``replay.capacity``), its help the setting's line of its group's docstring. Flags
default to None, so :func:`given_settings` knows which ones the command line gave."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from shardreplay.cli import field_help
from shardreplay.runtime.settings import ALGOS, FLAT, GROUPS, flat_name

_GROUP_TITLES = {
    "run": "run (what runs, when it stops, evaluation)",
    "learners": "learners (ranks and Q-learning)",
    "replay": "replay (buffer, prioritization, sampling)",
    "actors": "actors (environments, chunks, exploration)",
    "transport": "transport (where chunks and weights travel)",
    "checkpoints": "checkpoints",
}
_METAVARS = {"env_id": "ID", "run_dir": "DIR", "stop_return": "X|none|auto", "transport": "URL",
             "policy_url": "URL", "delivery_log_dir": "DIR", "prefill": "minari:ID", "offline": "minari:ID"}
_CHOICES = {"sample_mode": ("exact", "local"), "algo": ALGOS}


def _default_text(value: Any) -> str:
    if isinstance(value, bool):
        return " (default: on)" if value else " (default: off)"
    if value == "":
        return ""
    if isinstance(value, tuple):
        return f" (default: {' '.join(str(v) for v in value)})"
    if isinstance(value, int) and value >= 10_000:
        return f" (default: {value:_})"
    return f" (default: {value})"


def add_settings_flags(parser: argparse.ArgumentParser,
                       first: dict[str, Callable[[Any], None]] | None = None) -> dict[str, Any]:
    """Add one flag per setting, in one argument group per settings group; ``first``
    adds a group's other flags before its settings. Returns the argument groups by name."""
    groups, texts = {}, settings_help()
    for group, cls in GROUPS.items():
        arg_group = parser.add_argument_group(_GROUP_TITLES[group])
        groups[group] = arg_group
        if first and group in first:
            first[group](arg_group)
        defaults = cls()
        for f in dataclasses.fields(cls):
            flat = flat_name(f)
            value = getattr(defaults, f.name)
            text = texts[flat] + _default_text(value)
            flag = "--" + flat.replace("_", "-")
            if isinstance(value, bool):
                arg_group.add_argument(flag, dest=flat, action=argparse.BooleanOptionalAction, default=None,
                                       help=text)
            elif isinstance(value, tuple):
                arg_group.add_argument(flag, dest=flat, type=int, nargs="+", default=None, metavar="N",
                                       help=text)
            else:
                kind = type(value)
                arg_group.add_argument(flag, dest=flat, type=kind, default=None, help=text,
                                       choices=_CHOICES.get(flat),
                                       metavar=None if flat in _CHOICES else _METAVARS.get(
                                           flat, {int: "N", float: "X"}.get(kind, "TEXT")))
    return groups


def settings_help() -> dict[str, str]:
    """Each setting's ``--help`` text (its line of its group's docstring), by flat name."""
    return {flat_name(f): field_help(cls)[f.name] for cls in GROUPS.values() for f in dataclasses.fields(cls)}


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line gave, by flat name."""
    return {name: getattr(args, name) for name in FLAT if getattr(args, name, None) is not None}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Flags and their help side by side, the help column at a fixed place."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34)
