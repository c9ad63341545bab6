"""Policy broadcast: the learner publishes ``(version, weights)``, actors poll for new ones.

One interface, chosen by URL with :func:`open_publisher` / :func:`open_subscriber`:

- ``file:///dir``: ``dir/policy.safetensors`` (temp name, fsync, rename) and then a small
  ``dir/policy.version`` note with the version and the weights' CRC-32.
- ``redis://host:port/db``: one hash holding version, CRC-32 and weights, set by one
  ``HSET`` (atomic), then a pub/sub message that is only a hint.

Weights travel as safetensors (never pickle) with the version in their metadata::

    publisher = open_publisher("file:///run/policy")
    publisher.publish(7, model.state_dict())

    subscriber = open_subscriber("file:///run/policy", check_interval_s=1.0)
    update = subscriber.poll()          # cheap: None unless a newer version is there
    if update is not None:
        model.load_state_dict(update.weights)

``poll`` looks at the version at most every ``check_interval_s`` (Redis: at once when a
notification arrived; a lost notification costs at most one interval) and loads weights
only when the version grew. Versions must increase; a learner resumed from a checkpoint
goes on from its saved version. A damaged or inconsistent copy is logged, counted in
``stats`` and skipped; the actor keeps its current weights.
"""

from __future__ import annotations

import json
import logging
import struct
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from urllib.parse import urlparse

from shardreplay.errors import ConfigError, TransportTimeout

if TYPE_CHECKING:
    import torch

__all__ = [
    "PolicyPublisher",
    "PolicySubscriber",
    "PolicyUpdate",
    "SubscriberStats",
    "open_publisher",
    "open_subscriber",
    "wait_for_policy",
]

logger = logging.getLogger("shardreplay.policy")
VERSION_KEY = "shardreplay.policy_version"


@dataclass(frozen=True)
class PolicyUpdate:
    """A newly loaded policy.

    Attributes:
        version: its version.
        weights: name -> CPU tensor, ready for ``load_state_dict``.
    """

    version: int
    weights: dict[str, torch.Tensor]


@dataclass
class SubscriberStats:
    """What a subscriber did: version checks, weight loads, rejected copies by reason."""

    checks: int = 0
    loads: int = 0
    rejected: dict[str, int] = field(default_factory=dict)

    def reject(self, reason: str, detail: str) -> None:
        """Count and log one rejected copy of the weights."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        logger.warning("policy: rejected weights (%s): %s", reason, detail)


@runtime_checkable
class PolicyPublisher(Protocol):
    """The learner's end."""

    def publish(self, version: int, weights: Mapping[str, Any]) -> None:
        """Make ``weights`` the current policy, atomically.

        Args:
            version: larger than every version published before.
            weights: name -> torch tensor or numpy array (a ``state_dict``).

        Raises:
            ConfigError: the version does not increase, or a value is not a tensor.
            TransportError / TransportTimeout: the medium failed.
        """
        ...

    def close(self) -> None:
        """Release resources."""
        ...


@runtime_checkable
class PolicySubscriber(Protocol):
    """An actor's end."""

    version: int | None
    stats: SubscriberStats

    def poll(self) -> PolicyUpdate | None:
        """The newest policy if its version is above ``version``, else None (cheap)."""
        ...

    def pause(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s``, waking early when the medium hints at news."""
        ...

    def close(self) -> None:
        """Release resources."""
        ...


def check_version(version: Any, last: int | None) -> int:
    """``version`` as an int, if it is above ``last``.

    Raises:
        ConfigError: not a non-negative integer, or not above ``last``.
    """
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ConfigError(f"a policy version must be an integer >= 0, got {version!r}")
    if last is not None and version <= last:
        raise ConfigError(f"policy version {version} does not increase (last published: {last})")
    return version


def serialize(version: int, weights: Mapping[str, Any]) -> bytes:
    """Weights as safetensors bytes with ``version`` in the metadata.

    Raises:
        ConfigError: a value is neither a torch tensor nor a numpy array.
    """
    import numpy as np
    import torch
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    for name, value in weights.items():
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(np.ascontiguousarray(value))
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"weight {name!r} is a {type(value).__name__}, not a tensor or array")
        # a private contiguous CPU copy: tied weights must not share storage in safetensors
        tensors[name] = value.detach().to("cpu", copy=True).contiguous()
    return save(tensors, metadata={VERSION_KEY: str(version)})


def read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes without loading tensors.

    Raises:
        ValueError: the header is malformed.
    """
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack_from("<Q", data)
    if n > min(len(data) - 8, 100 << 20):
        raise ValueError(f"safetensors header of {n} bytes is impossible here")
    header = json.loads(bytes(data[8:8 + n]))
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise ValueError("safetensors header is not a map")
    return meta


def deserialize(data: bytes, expect_crc: int | None, stats: SubscriberStats,
                origin: str) -> PolicyUpdate | None:
    """Checked weights from safetensors bytes; None (logged, counted) when damaged."""
    from safetensors.torch import load

    if expect_crc is not None and zlib.crc32(data) != expect_crc:
        stats.reject("checksum", f"{origin}: weights do not match their checksum")
        return None
    try:
        version = int(read_metadata(data)[VERSION_KEY])
        weights = load(data)
    except Exception as exc:  # safetensors, json and int() raise unrelated types on garbage
        stats.reject("format", f"{origin}: {exc}")
        return None
    stats.loads += 1
    return PolicyUpdate(version, weights)


def wait_for_policy(subscriber: PolicySubscriber, timeout_s: float) -> PolicyUpdate:
    """Block until ``subscriber`` loads a policy newer than its current one.

    Raises:
        TransportTimeout: none arrived within ``timeout_s`` (has the learner published?).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        update = subscriber.poll()
        if update is not None:
            return update
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportTimeout(f"no policy newer than version {subscriber.version} within "
                                   f"{timeout_s} s: has the learner published one?")
        subscriber.pause(min(left, 0.05))


def _split(url: str) -> tuple[str, str]:
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path:
            raise ConfigError(f"policy broadcast needs file:///absolute/dir, got {url!r}")
        return "file", parsed.path
    if parsed.scheme in ("redis", "rediss", "unix"):
        return "redis", url
    raise ConfigError(f"unknown policy broadcast URL {url!r}: use 'file:///dir' or 'redis://host:port/db'")


def open_publisher(url: str, **options: Any) -> PolicyPublisher:
    """The learner's end for ``file:///dir`` or ``redis://...``.

    Raises:
        ConfigError: an unknown URL or option.
    """
    kind, where = _split(url)
    try:
        if kind == "file":
            from shardreplay.policy.file_backend import FilePublisher

            return FilePublisher(where, **options)
        from shardreplay.policy.redis_backend import RedisPublisher

        return RedisPublisher(where, **options)
    except TypeError as exc:
        raise ConfigError(f"bad option for policy publisher {url!r}: {exc}") from exc


def open_subscriber(url: str, **options: Any) -> PolicySubscriber:
    """An actor's end for ``file:///dir`` or ``redis://...``.

    Raises:
        ConfigError: an unknown URL or option.
    """
    kind, where = _split(url)
    try:
        if kind == "file":
            from shardreplay.policy.file_backend import FileSubscriber

            return FileSubscriber(where, **options)
        from shardreplay.policy.redis_backend import RedisSubscriber

        return RedisSubscriber(where, **options)
    except TypeError as exc:
        raise ConfigError(f"bad option for policy subscriber {url!r}: {exc}") from exc
