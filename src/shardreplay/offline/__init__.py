"""A run's experience as a Minari dataset, and Minari datasets back into replay.

``export_checkpoint(root, dataset_id, ...)`` writes the steps of a sharded checkpoint
as a Minari dataset (episodes reassembled per saved stream; Minari's N + 1
observations; priorities, actor and stream ids in the step infos; partial episodes
sealed or dropped and counted in the dataset's metadata); ``prefill(buffer,
dataset_id)`` deals a dataset's episodes into a ReplayBuffer or the shards of a
ShardedReplayBuffer. docs/offline.md has the conventions table. ``minari`` (the
``shardreplay[minari]`` extra) is imported only when one of these runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardreplay._lazy import lazy_exports

if TYPE_CHECKING:
    from shardreplay.offline.minari_io import (
        ChunkEpisodes,
        Episode,
        episodes_of_checkpoint,
        export_checkpoint,
        prefill,
        write_dataset,
    )

__all__ = ["ChunkEpisodes", "Episode", "episodes_of_checkpoint", "export_checkpoint", "prefill",
           "write_dataset"]

_HOMES = dict.fromkeys(__all__, "shardreplay.offline.minari_io")

__getattr__, __dir__ = lazy_exports("shardreplay.offline", globals(), _HOMES)
