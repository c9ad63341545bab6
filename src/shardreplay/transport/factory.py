"""The one place that maps a URL to a transport.

Kept apart from :mod:`shardreplay.transport.base` (the interfaces every transport
implements), so that the transports import the interfaces and only this module names
the transports: no import circle, and redis is imported only when a ``redis://`` URL is
opened.
"""

from __future__ import annotations

from typing import Any

from shardreplay.errors import ConfigError
from shardreplay.spec import Spec
from shardreplay.transport.base import Transport
from shardreplay.transport.urls import parse_medium

__all__ = ["open_transport"]


def open_transport(url: str, spec: Spec, **options: Any) -> Transport:
    """Open the transport a URL names.

    Args:
        url: ``"local"``, ``"file:///abs/dir"`` or ``"redis://host:port/db"``.
        spec: the spec every chunk must follow.
        **options: keyword settings of the chosen transport (see ``LocalTransport``,
            ``SpoolTransport``, ``RedisTransport``).

    Raises:
        ConfigError: an unknown scheme, a malformed URL or an unknown option.
    """
    medium = parse_medium(url, what="transport")
    try:
        if medium.kind == "local":
            from shardreplay.transport.local import LocalTransport

            return LocalTransport(spec, **options)
        if medium.kind == "file":
            from shardreplay.transport.spool import SpoolTransport

            return SpoolTransport(medium.path, spec, **options)
        from shardreplay.transport.redis import RedisTransport

        return RedisTransport(url, spec, **options)
    except TypeError as exc:  # an unknown keyword option
        raise ConfigError(f"bad option for transport {url!r}: {exc}") from exc
