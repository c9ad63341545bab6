"""Which learner shard an actor's streams belong to, and that shard's transport.

An actor's streams all go to one shard, ``actor_id % num_shards``: deterministic, and
recomputed from the new count when a run resumes with another number of learners.
Each shard has its own channel on the medium: ``file:///dir`` -> ``dir/shard-<k>``,
``redis://...`` -> stream ``shardreplay:chunks:<k>``, ``local`` -> its own ring.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from shardreplay.errors import ConfigError
from shardreplay.spec import Spec
from shardreplay.transport import open_transport
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
    if scheme in ("file", "redis"):
        return scheme
    raise ConfigError(f"transport URL {url!r}: use 'local', 'file:///dir' or 'redis://host:port/db'")


def shard_transport(url: str, spec: Spec, shard: int, **options: Any) -> Transport:
    """The transport of learner shard ``shard`` (see the module docstring)."""
    scheme = scheme_of(url)
    if scheme == "file":
        return open_transport(url.rstrip("/") + f"/shard-{shard}", spec, **options)
    if scheme == "redis":
        return open_transport(url, spec, stream=f"shardreplay:chunks:{shard}", **options)
    return open_transport("local", spec, **options)
