"""Which learner shard an actor's streams belong to, and that shard's transport.

An actor's streams all go to one shard, ``actor_id % num_shards``: deterministic, and
recomputed from the new count when a run resumes with another number of learners.
Each shard has its own channel on the medium: ``file:///dir`` -> ``dir/shard-<k>``,
``redis://...`` -> stream ``shardreplay:chunks:<k>``, ``local`` -> its own ring.
"""

from __future__ import annotations

from urllib.parse import urlparse

import numpy as np

from shardreplay.errors import ConfigError
from shardreplay.spec import Spec
from shardreplay.transport import Chunk, encode, open_transport
from shardreplay.transport.base import Transport


def shard_for_actor(actor_id: int, num_shards: int) -> int:
    """The learner shard that owns actor ``actor_id``'s streams.

    Raises:
        ConfigError: a negative actor id or fewer than one shard.
    """
    if actor_id < 0 or num_shards < 1:
        raise ConfigError(f"need actor_id >= 0 and num_shards >= 1, got {actor_id}, {num_shards}")
    return actor_id % num_shards


def scheme_of(url: str) -> str:
    """``"local"``, ``"file"`` or ``"redis"``.

    Raises:
        ConfigError: another scheme.
    """
    if url in ("", "local", "local://"):
        return "local"
    scheme = urlparse(url).scheme
    if scheme == "file":
        return scheme
    if scheme in ("redis", "rediss", "unix"):  # every URL the redis transport opens
        return "redis"
    raise ConfigError(f"transport URL {url!r}: use 'local', 'file:///dir' or 'redis://host:port/db'")


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
    return len(encode(chunk, spec)) + 64


def shard_transport(url: str, spec: Spec, shard: int, *, queued_per_actor: int | None = None,
                    actors: int = 1, chunk_size_bytes: int | None = None) -> Transport:
    """The transport of learner shard ``shard`` (see the module docstring).

    ``queued_per_actor`` bounds the chunks that wait in the medium for each of the
    shard's ``actors`` (None: the medium's default). A short queue keeps the data fresh:
    actors block, then act with the newest policy, instead of filling a long queue with
    steps of an old one. ``local`` needs ``chunk_size_bytes`` to size its ring.
    """
    scheme = scheme_of(url)
    if scheme == "file":
        opts = {} if queued_per_actor is None else {"max_pending_per_actor": queued_per_actor}
        return open_transport(url.rstrip("/") + f"/shard-{shard}", spec, **opts)
    if scheme == "redis":
        opts = {} if queued_per_actor is None else {"max_len": queued_per_actor * max(actors, 1)}
        return open_transport(url, spec, stream=f"shardreplay:chunks:{shard}", **opts)
    if queued_per_actor is None or chunk_size_bytes is None:
        return open_transport("local", spec)
    # Room for exactly the chunks asked for (a ring record is 8 bytes + the chunk): a
    # floor of 64 KiB here once let a CartPole actor queue ~45 chunks instead of 2.
    ring = queued_per_actor * max(actors, 1) * (chunk_size_bytes + 8)
    return open_transport("local", spec, capacity_bytes=ring)
