"""``redis://`` policy broadcast: one hash per policy key, plus a pub/sub hint.

The publisher sets ``version``, ``run``, ``crc32`` and ``weights`` of hash ``key`` in one
``HSET`` (a reader sees all old or all new fields), then publishes the version on
``key + ":news"``. A subscriber reads ``HMGET version run`` on a check and the whole hash
(one ``HGETALL``) only when the version grew or the run changed; it checks on a hint and
at least every ``check_interval_s``, so a lost hint costs one interval and a late
subscriber still finds the current policy.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardreplay.errors import TransportTimeout
from shardreplay.policy.broadcast import (
    PolicyPublisher,
    PolicySubscriber,
    PolicyUpdate,
)
from shardreplay.transport.redis import HintChannel, RedisLink

if TYPE_CHECKING:
    from redis.typing import EncodableT

__all__ = ["RedisPublisher", "RedisSubscriber"]


class RedisPublisher(PolicyPublisher):
    """Publishes policies into the Redis hash ``key`` (hints go to ``key + ":news"``); a
    publish waits up to ``timeout_s`` for an unreachable server."""

    def __init__(self, url: str, *, key: str = "shardreplay:policy", timeout_s: float = 30.0) -> None:
        self._link = RedisLink(url)
        self._key = key
        self._timeout_s = timeout_s
        self._hints = HintChannel(self._link, key + ":news")

    def _write(self, version: int, data: bytes, run: str) -> None:
        mapping: dict[EncodableT, EncodableT] = {"version": str(version), "run": run,
                                                 "crc32": str(zlib.crc32(data)), "weights": data}
        self._link.call(lambda r: r.hset(self._key, mapping=mapping), what="HSET policy",
                        deadline=time.monotonic() + self._timeout_s)
        self._hints.publish(str(version))

    def close(self) -> None:
        """Close the connection."""
        self._hints.close()
        self._link.close()


class RedisSubscriber(PolicySubscriber):
    """Polls the publisher's Redis hash ``key`` for new policies, at least every
    ``check_interval_s`` without a hint (``as_numpy``: numpy arrays, torch never loads).

    Raises:
        ConfigError: a negative interval.
    """

    def __init__(self, url: str, *, key: str = "shardreplay:policy", check_interval_s: float = 1.0,
                 as_numpy: bool = False) -> None:
        super().__init__(check_interval_s, as_numpy)
        self._link = RedisLink(url)
        self._key = key
        self._hints = HintChannel(self._link, key + ":news")

    def poll(self) -> PolicyUpdate | None:
        """The newest policy if it is newer than ``version`` or another run's; else None.

        A server that does not answer counts as "nothing new" (logged by the link).
        """
        if not self._due(self._hints.wait(0.0)):
            return None
        now = time.monotonic()
        try:
            raw, run = self._link.call(lambda r: r.hmget(self._key, "version", "run"), what="HMGET version",
                                       deadline=now)
            if raw is None or not self._is_news(int(raw), _text(run)):
                return None
            fields = self._link.call(lambda r: _bytes_hash(r.hgetall(self._key)), what="HGETALL policy",
                                     deadline=now)
        except TransportTimeout:
            return None
        except ValueError:
            self.stats.reject("format", f"version field {raw!r} is not an integer")
            return None
        return self._accept(fields)

    def _accept(self, fields: dict[bytes, bytes]) -> PolicyUpdate | None:
        marker = (fields.get(b"version", b""), fields.get(b"crc32", b""))
        if marker == self._bad:
            return None  # already rejected; wait for the next publish
        try:
            version, crc, data = int(marker[0]), int(marker[1]), fields[b"weights"]
        except (ValueError, KeyError) as exc:
            self._bad = marker
            self.stats.reject("format", f"policy hash lacks a field or is malformed: {exc}")
            return None
        # The hash's run: what the next check compares.
        return self._take(data, crc, version, fields.get(b"run", b"").decode(errors="replace"),
                          f"redis key {self._key}", marker)

    def pause(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s``, waking at once on a hint."""
        if self._hints.wait(timeout_s):
            self._next_check = 0.0
        else:
            self._next_check = min(self._next_check, time.monotonic())

    def close(self) -> None:
        """Close the connections."""
        self._hints.close()
        self._link.close()


def _text(value: bytes | str | None) -> str:
    """A reply field as text (the link's client returns bytes; None: absent)."""
    return value.decode() if isinstance(value, bytes) else (value or "")


def _bytes_hash(reply: Mapping[Any, Any]) -> dict[bytes, bytes]:
    """An ``HGETALL`` reply of a client that does not decode: bytes names and values."""
    return {k: v for k, v in reply.items() if isinstance(k, bytes) and isinstance(v, bytes)}
