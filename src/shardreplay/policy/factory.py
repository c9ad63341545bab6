"""The one place that maps a URL to a policy publisher or subscriber.

Kept apart from :mod:`shardreplay.policy.broadcast` (the interfaces and the weights'
format, which the backends import), so that only this module names the backends: no
import circle, and redis is imported only when a ``redis://`` URL is opened.
"""

from __future__ import annotations

from typing import Any

from shardreplay.errors import ConfigError
from shardreplay.policy.broadcast import PolicyPublisher, PolicySubscriber
from shardreplay.transport.urls import POLICY_KEY, parse_medium, pop_query

__all__ = ["open_publisher", "open_subscriber"]


def _split(url: str) -> tuple[str, str]:
    medium = parse_medium(url, kinds=("file", "redis"), what="policy broadcast")
    # a Redis URL's ``key`` option is the backend's (see _redis_options)
    return (medium.kind, medium.path) if medium.kind == "file" else (medium.kind, url)


def _redis_options(url: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The URL for redis-py and the backend's options: the URL's ``key`` query option
    (:mod:`shardreplay.transport.urls`) names the policy hash unless ``key`` is given."""
    bare, key = pop_query(url, POLICY_KEY)
    if key and "key" not in options:
        options = {**options, "key": key}
    return bare, options


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

        where, options = _redis_options(where, options)
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

        where, options = _redis_options(where, options)
        return RedisSubscriber(where, **options)
    except TypeError as exc:
        raise ConfigError(f"bad option for policy subscriber {url!r}: {exc}") from exc
