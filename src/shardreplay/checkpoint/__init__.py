"""Sharded checkpoints: every rank saves its part, any M parts restore onto N ranks.

Use as ``shardreplay.checkpoint.save(buffer, path, checkpoint_id)`` and
``shardreplay.checkpoint.load(path, buffer)``; ``save_in_background`` returns at once
and writes from a thread (the checkpoint is the buffer at the call), and
``incremental=True`` writes only the rows new since the previous checkpoint;
:class:`CheckpointTrigger` decides when
(periodic, on request, on SIGTERM, after a crash).
"""

from __future__ import annotations

from shardreplay.checkpoint.background import PendingSave, save_in_background
from shardreplay.checkpoint.episodes import PARTIAL_POLICIES
from shardreplay.checkpoint.load import LoadReport, load
from shardreplay.checkpoint.manifest import (
    INCOMPLETE_DIR,
    checkpoint_dir,
    damage,
    incomplete_checkpoints,
    is_complete,
    latest_complete,
    list_checkpoints,
    load_manifest,
    read_manifest,
    set_aside,
    set_aside_incomplete,
)
from shardreplay.checkpoint.records import FileEntry, Manifest, ManifestPart, RestoreCounts
from shardreplay.checkpoint.save import save
from shardreplay.checkpoint.triggers import REQUEST_FILE, CheckpointTrigger

__all__ = [
    "INCOMPLETE_DIR",
    "PARTIAL_POLICIES",
    "REQUEST_FILE",
    "CheckpointTrigger",
    "FileEntry",
    "LoadReport",
    "Manifest",
    "ManifestPart",
    "PendingSave",
    "RestoreCounts",
    "checkpoint_dir",
    "damage",
    "incomplete_checkpoints",
    "is_complete",
    "latest_complete",
    "list_checkpoints",
    "load",
    "load_manifest",
    "read_manifest",
    "save",
    "save_in_background",
    "set_aside",
    "set_aside_incomplete",
]
