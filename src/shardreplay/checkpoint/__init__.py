"""Sharded checkpoints: every rank saves its part, any M parts restore onto N ranks.

Use as ``shardreplay.checkpoint.save(buffer, path, checkpoint_id)`` and
``shardreplay.checkpoint.load(path, buffer)``.
"""

from __future__ import annotations

from shardreplay.checkpoint.episodes import PARTIAL_POLICIES
from shardreplay.checkpoint.load import LoadReport, load
from shardreplay.checkpoint.manifest import (
    checkpoint_dir,
    is_complete,
    latest_complete,
    list_checkpoints,
    read_manifest,
)
from shardreplay.checkpoint.save import save

__all__ = [
    "PARTIAL_POLICIES",
    "LoadReport",
    "checkpoint_dir",
    "is_complete",
    "latest_complete",
    "list_checkpoints",
    "load",
    "read_manifest",
    "save",
]
