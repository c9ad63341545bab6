"""Policy broadcast from the learner to actors: ``file:///dir`` or ``redis://``.

See :mod:`shardreplay.policy.broadcast`. The URL is mapped to a backend here (not in
``broadcast``, which the backends import); redis, torch and safetensors are imported only
when first used.
"""

from __future__ import annotations

from typing import Any, cast

from shardreplay.errors import ConfigError
from shardreplay.policy.broadcast import (
    PolicyPublisher,
    PolicySubscriber,
    PolicyUpdate,
    SubscriberStats,
    wait_for_policy,
)
from shardreplay.transport.urls import POLICY_KEY, parse_medium, pop_query

__all__ = [
    "PolicyPublisher",
    "PolicySubscriber",
    "PolicyUpdate",
    "SubscriberStats",
    "open_publisher",
    "open_subscriber",
    "wait_for_policy",
]


def _open(url: str, role: str, options: dict[str, Any]) -> Any:
    """``File<role>(dir)`` or ``Redis<role>(url)``; the backend (and redis) imported now."""
    medium = parse_medium(url, kinds=("file", "redis"), what="policy broadcast")
    if medium.kind == "file":
        import shardreplay.policy.file_backend as module

        where = medium.path
    else:
        import shardreplay.policy.redis_backend as module  # type: ignore[no-redef]

        # The URL's ``key`` query option (:mod:`shardreplay.transport.urls`) names the policy
        # hash, unless a ``key`` option is given; redis-py gets the URL without it.
        where, key = pop_query(url, POLICY_KEY)
        options = {"key": key, **options} if key else options
    try:
        return getattr(module, f"{medium.kind.capitalize()}{role.capitalize()}")(where, **options)
    except TypeError as exc:
        raise ConfigError(f"bad option for policy {role} {url!r}: {exc}") from exc


def open_publisher(url: str, **options: Any) -> PolicyPublisher:
    """The learner's end for ``file:///dir`` or ``redis://...``.

    Raises:
        ConfigError: an unknown URL or option.
    """
    return cast(PolicyPublisher, _open(url, "publisher", options))


def open_subscriber(url: str, **options: Any) -> PolicySubscriber:
    """An actor's end for ``file:///dir`` or ``redis://...``.

    Raises:
        ConfigError: an unknown URL or option.
    """
    return cast(PolicySubscriber, _open(url, "subscriber", options))
