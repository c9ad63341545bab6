"""A run's experience as a Minari dataset (``export_checkpoint``, ``write_dataset``), and
Minari datasets back into replay (``prefill``): docs/offline.md. ``minari`` (the
``shardreplay[minari]`` extra) is imported only when one of these runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardreplay._lazy import lazy_exports

if TYPE_CHECKING:
    from shardreplay.offline.minari_io import (
        CheckpointEpisodes,
        ChunkEpisodes,
        Episode,
        export_checkpoint,
        prefill,
        write_dataset,
    )

__all__ = ["CheckpointEpisodes", "ChunkEpisodes", "Episode", "export_checkpoint", "prefill",
           "write_dataset"]

_HOMES = dict.fromkeys(__all__, "shardreplay.offline.minari_io")

__getattr__, __dir__ = lazy_exports("shardreplay.offline", globals(), _HOMES)
