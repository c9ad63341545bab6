"""Sharded checkpoints: every rank saves its part (:func:`save`; :func:`save_in_background`
from a forked child), any M parts restore onto N ranks (:func:`load`);
:class:`CheckpointTrigger` decides when. docs/semantics.md, "Checkpoints".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardreplay._lazy import lazy_exports

if TYPE_CHECKING:
    from shardreplay.checkpoint.background import PendingSave, save_in_background
    from shardreplay.checkpoint.loading import LoadReport, load
    from shardreplay.checkpoint.manifest import (
        checkpoint_dir,
        is_complete,
        latest_complete,
        list_checkpoints,
        load_manifest,
        set_aside,
    )
    from shardreplay.checkpoint.records import Manifest
    from shardreplay.checkpoint.saving import save
    from shardreplay.checkpoint.triggers import CheckpointTrigger

# Public names load on first use (PEP 562), as in the package root: the launcher reads
# manifests without importing the buffer (and with it torch: seconds per process).
_HOMES = {
    **dict.fromkeys(["PendingSave", "save_in_background"], "shardreplay.checkpoint.background"),
    **dict.fromkeys(["LoadReport", "load"], "shardreplay.checkpoint.loading"),
    **dict.fromkeys(["checkpoint_dir", "is_complete", "latest_complete", "list_checkpoints", "load_manifest",
                     "set_aside"], "shardreplay.checkpoint.manifest"),
    "Manifest": "shardreplay.checkpoint.records",
    "save": "shardreplay.checkpoint.saving",
    "CheckpointTrigger": "shardreplay.checkpoint.triggers",
}


__getattr__, __dir__ = lazy_exports("shardreplay.checkpoint", globals(), _HOMES)


__all__ = [
    "CheckpointTrigger",
    "LoadReport",
    "Manifest",
    "PendingSave",
    "checkpoint_dir",
    "is_complete",
    "latest_complete",
    "list_checkpoints",
    "load",
    "load_manifest",
    "save",
    "save_in_background",
    "set_aside",
]
