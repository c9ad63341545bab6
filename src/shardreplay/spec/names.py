"""Nested field names: ``{"obs": {"pos": x}}`` and its dotted form ``{"obs.pos": x}``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardreplay.errors import ConfigError

SEP = "."


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings into ``{"a.b": leaf}``; leaves are anything else.

    Raises:
        ConfigError: a key that is not a non-empty string.
    """
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"field names must be non-empty strings, got {key!r}")
        name = prefix + key
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + SEP))
        else:
            flat[name] = value
    return flat


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`flatten`: ``{"a.b": x}`` -> ``{"a": {"b": x}}``."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split(SEP)
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree
