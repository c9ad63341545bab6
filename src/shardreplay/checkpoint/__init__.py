"""Sharded checkpoints: every rank saves its part, any M parts restore onto N ranks.

Use as ``shardreplay.checkpoint.save(buffer, path, checkpoint_id)`` and
``shardreplay.checkpoint.load(path, buffer)``; ``save_in_background`` returns at once
and writes from a thread (the checkpoint is the buffer at the call), and
``incremental=True`` writes only the rows new since the previous checkpoint;
:class:`CheckpointTrigger` decides when
(periodic, on request, on SIGTERM, after a crash).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardreplay._lazy import lazy_exports

if TYPE_CHECKING:
    from shardreplay.checkpoint.background import PendingSave, save_in_background
    from shardreplay.checkpoint.episodes import PARTIAL_POLICIES
    from shardreplay.checkpoint.loading import LoadReport, load
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
    from shardreplay.checkpoint.saving import save
    from shardreplay.checkpoint.triggers import REQUEST_FILE, CheckpointTrigger

# Public names load on first use (PEP 562), as in the package root: the launcher reads
# manifests without importing the buffer (and with it torch: seconds per process).
_HOMES = {
    **dict.fromkeys(["PendingSave", "save_in_background"], "shardreplay.checkpoint.background"),
    "PARTIAL_POLICIES": "shardreplay.checkpoint.episodes",
    **dict.fromkeys(["LoadReport", "load"], "shardreplay.checkpoint.loading"),
    **dict.fromkeys(["INCOMPLETE_DIR", "checkpoint_dir", "damage", "incomplete_checkpoints", "is_complete",
                     "latest_complete", "list_checkpoints", "load_manifest", "read_manifest", "set_aside",
                     "set_aside_incomplete"], "shardreplay.checkpoint.manifest"),
    **dict.fromkeys(["FileEntry", "Manifest", "ManifestPart", "RestoreCounts"],
                    "shardreplay.checkpoint.records"),
    "save": "shardreplay.checkpoint.saving",
    **dict.fromkeys(["REQUEST_FILE", "CheckpointTrigger"], "shardreplay.checkpoint.triggers"),
}


__getattr__, __dir__ = lazy_exports("shardreplay.checkpoint", globals(), _HOMES)


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
