"""Each learner shard's transport: its own channel on the medium, named after the run
(docs/semantics.md, "Chunks across crashes"), and the checks made before a run starts."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from shardreplay._io import storage_error
from shardreplay.errors import ConfigError, ShardReplayError, StorageError
from shardreplay.runtime.envs import transition_spec
from shardreplay.runtime.run_identity import check_run_id
from shardreplay.runtime.settings import TrainSettings
from shardreplay.spec import Spec
from shardreplay.transport import Chunk, open_transport
from shardreplay.transport.base import Transport
from shardreplay.transport.codec import Encoding, spec_has_frame_stacks
from shardreplay.transport.urls import file_url, parse_medium

log = logging.getLogger("shardreplay.learner")


def check_reachable(url: str, timeout_s: float = 5.0) -> None:
    """For a ``redis://`` URL: fail at once (within ``timeout_s``) when its server does
    not answer, instead of after the transport's retries; other URLs pass.

    Raises:
        TransportError: "cannot reach redis at host:port ...".
    """
    if url and parse_medium(url).kind == "redis":
        from shardreplay.transport.redis import check_reachable as ping

        ping(url, timeout_s)


def check_writable(url: str) -> None:
    """For a ``file://`` URL: fail at once when its directory (or its nearest existing
    parent: nothing is created) refuses a new file; other URLs pass.

    Raises:
        StorageError: "transport file:///x: cannot write /x: Read-only file system (EROFS)".
        ConfigError: a file stands where the directory should be.
    """
    if not url or parse_medium(url).kind != "file":
        return
    directory = Path(parse_medium(url).path)
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    if not directory.is_dir():
        raise ConfigError(f"transport {url}: {directory} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".shardreplay-probe-", dir=directory)
    except OSError as exc:
        exc.filename = str(directory)  # the directory refused, not the probe's name
        refused = storage_error(exc)
        if refused is None:
            raise ConfigError(f"transport {url}: {exc}") from None
        raise StorageError(f"transport {url}: {refused}", path=refused.path, errno=refused.errno) from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)


def chunk_bytes(spec: Spec, streams: int, steps: int) -> int:
    """An upper bound of the encoded size of a chunk of ``streams`` x ``steps``: a chunk
    with the largest ids and with priorities, encoded, plus a little slack."""
    full = (streams, steps)
    arrays = {name: np.zeros(full + f.shape, f.dtype) for name, f in spec.fields.items()}
    arrays["step_type"] = np.zeros(full, np.uint8)
    arrays["discount"] = np.ones(full, np.float32)
    big = (1 << 63) - 1
    chunk = Chunk(actor_id=big, sequence=big, policy_version=big,
                  stream_ids=np.arange(big - streams + 1, big + 1, dtype=np.int64), steps=arrays,
                  priorities=np.ones(full, np.float32))
    # The size only: writing it would load the validation kernels (numba) into a launcher
    # that otherwise never needs them.
    return Encoding(chunk, spec).nbytes + 64


def shard_transport(url: str, spec: Spec, shard: int, *, run_id: str = "",
                    queued_chunks_per_actor: int | None = None, actors: int = 1,
                    chunk_size_bytes: int | None = None, compression: str = "auto") -> Transport:
    """The transport of learner shard ``shard`` of run ``run_id`` (see the module docstring).
    ``compression`` (of what writers send on ``file://`` and ``redis://``): ``auto`` is
    ``lz4`` for a spec with a ``frame_stack`` field, else ``none``.
    ``queued_chunks_per_actor`` bounds the chunks waiting per actor of the shard's
    ``actors`` (None: the medium's default; a short queue keeps the data fresh): per
    actor on a spool, ``bound x actors`` entries on Redis, ring bytes for ``local``
    (sized from ``chunk_size_bytes``).

    Raises:
        ConfigError: a bad URL or run id.
    """
    kind, run_id = parse_medium(url).kind, check_run_id(run_id)
    bound = queued_chunks_per_actor
    if compression == "auto":
        compression = "lz4" if spec_has_frame_stacks(spec) else "none"
    opts: dict[str, Any] = {"compression": compression}
    if kind == "file":  # the spool names its shard directories (nothing is created here)
        if bound is not None:
            opts["queued_chunks_per_actor"] = bound
        return open_transport(file_url(open_transport(url, spec).channel(shard, run_id)), spec, **opts)
    if kind == "redis":
        if bound is not None:
            opts["max_len"] = bound * max(actors, 1)
        return open_transport(url, spec, stream=open_transport(url, spec).channel(shard, run_id), **opts)
    if bound is None or chunk_size_bytes is None:
        return open_transport("local", spec)
    # Room for exactly the chunks asked for (a ring record is 8 bytes + the chunk), no floor.
    ring = bound * max(actors, 1) * (chunk_size_bytes + 8)
    return open_transport("local", spec, capacity_bytes=ring)


def settings_transport(settings: TrainSettings, spec: Spec, shard: int, run_id: str = "") -> Transport:
    """Shard ``shard``'s transport on the run's medium, sized for a short queue of its
    actors' chunks (:func:`shard_transport`); a ``local`` ring is made, the other media opened."""
    a = settings.actors
    return shard_transport(settings.transport.url, spec, shard, run_id=run_id,
                           queued_chunks_per_actor=a.queued_chunks_per_actor,
                           actors=settings.streams.actors_of_shard(shard),
                           chunk_size_bytes=chunk_bytes(spec, a.envs_per_actor, a.chunk_steps))


def foreign_backlog(url: str, shard: int, run_id: str) -> dict[str, int]:
    """Chunks that other runs (or runs from before run ids) left waiting for ``shard`` on
    the medium at ``url``, by channel (never read), logged once here: files in a spool's
    ``ready/``, Redis entries their group has not acknowledged (entries consumed but not
    yet trimmed are not counted). A medium that cannot be searched gives ``{}`` (logged)."""
    if parse_medium(url).kind == "local":
        return {}  # another run's rings live in its own processes
    try:
        # Names and counts only: no chunk is decoded, so any spec does.
        medium = open_transport(url, transition_spec(1))
        mine = medium.channel(shard, check_run_id(run_id))
        found = {channel: waiting for channel in medium.channels(shard)
                 if channel != mine and (waiting := medium.backlog(channel).chunks)}
    except ShardReplayError as exc:
        log.warning("rank %d: could not look for other runs' chunks: %s", shard, exc)
        return {}
    if found:
        log.warning("rank %d: %d chunk(s) of other runs wait on %s (%s); this run (%s) ignores them: "
                    "delete them when those runs are over", shard, sum(found.values()), url,
                    ", ".join(f"{k}: {v}" for k, v in sorted(found.items())), run_id or "unnamed")
    return found
