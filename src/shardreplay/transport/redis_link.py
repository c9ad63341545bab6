"""Redis connections for the ``redis://`` transport and the Redis policy backend: a
client whose calls reconnect until a deadline and raise shardreplay errors, consumer
groups kept in place, trimming of what every group acknowledged, room tokens, the
writers' ``XADD`` packets and pub/sub hints (see :mod:`shardreplay.transport.redis`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlparse

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shardreplay.errors import ConfigError, TransportError, TransportTimeout
from shardreplay.secrets import ENV, connect_args, password_source, redact
from shardreplay.transport.codec import Encoding, PackedEncoding

__all__ = ["HintChannel", "RedisLink", "RoomTokens", "XaddPacker", "check_reachable", "ensure_group",
           "trim_acknowledged", "waiting_entries", "with_group"]

logger = logging.getLogger("shardreplay.transport")
T = TypeVar("T")


class RedisLink:
    """One Redis client whose calls reconnect on failure and raise shardreplay errors.

    Args:
        url: ``redis://host:port/db`` (or ``rediss://``, ``unix://``).
        socket_timeout_s: per-command socket timeout.
    """

    def __init__(self, url: str, *, socket_timeout_s: float = 5.0) -> None:
        self.url = redact(url)  # what messages show: never the password
        bare, password = connect_args(url)
        try:
            self.client = redis.Redis.from_url(
                bare, protocol=2, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
                retry=Retry(NoBackoff(), 0),  # retries are ours, bounded by the caller's deadline
                **({"password": password} if password is not None else {}))
        except ValueError as exc:
            raise ConfigError(f"bad redis URL {self.url!r}: {exc}") from exc
        self._down_since: float | None = None
        # Calls that failed on the connection and were tried again: a command may have run
        # on the server although its reply was lost (a caller that reads can then look again).
        self.failed_calls = 0

    def down_for_s(self) -> float:
        """Seconds since the server stopped answering (0 while it answers)."""
        return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    def call(self, fn: Callable[[redis.Redis], T], *, what: str, deadline: float | None) -> T:
        """Run ``fn(client)``; on a lost connection reconnect and retry until ``deadline``.

        Raises:
            TransportTimeout: the server did not answer before ``deadline`` (one attempt
                is always made).
            TransportError: Redis refused the command.
        """
        backoff = 0.01
        while True:
            try:
                result = fn(self.client)
                self._down_since = None
                return result
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self.failed_calls += 1
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    logger.warning("redis %s: %s failed (%s); reconnecting", self.url, what, exc)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransportTimeout(f"redis {self.url} unreachable for {self.down_for_s():.1f} s "
                                           f"({what}): is redis-server running?") from exc
                time.sleep(backoff if left is None else min(backoff, left))
                backoff = min(backoff * 2, 0.5)
            except redis.RedisError as exc:
                raise TransportError(f"redis {self.url} refused {what}: {exc}") from exc

    def close(self) -> None:
        """Close the client's connections."""
        with contextlib.suppress(redis.RedisError):  # a dead connection needs no goodbye
            self.client.close()


def ensure_group(client: redis.Redis, stream: str, group: str) -> None:
    """Create ``group`` on ``stream`` at id 0 (the stream too) unless it exists."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):  # redis reports "exists" only in the message
            raise


def with_group(client: redis.Redis, stream: str, group: str, fn: Callable[[], T],
               on_recreate: Callable[[], None] | None = None) -> T:
    """Run ``fn``; if the group vanished (a server restarted without its data), recreate
    it, call ``on_recreate`` (to count what was lost) and run ``fn`` again."""
    try:
        return fn()
    except redis.ResponseError as exc:
        if "NOGROUP" not in str(exc):  # redis reports a missing group only in the message
            raise
        logger.warning("redis: group %r of stream %r was missing; recreated at id 0", group, stream)
        ensure_group(client, stream, group)
        if on_recreate is not None:
            on_recreate()
        return fn()


def waiting_entries(client: redis.Redis, stream: str, group: str, consumer: str) -> int | None:
    """Entries of ``stream`` that ``group`` has not yet delivered (its lag) plus those
    pending at consumers other than ``consumer``: what a server restart without
    persistence would lose. None when the group is missing or its lag unknown."""
    pipe = client.pipeline(transaction=False)
    pipe.xinfo_groups(stream)
    pipe.xpending(stream, group)
    try:
        groups, pending = pipe.execute()
    except redis.ResponseError:  # no stream or no group (yet)
        return None
    lag = next((g.get("lag") for g in groups if g.get("name") == group.encode()), None)
    if lag is None:
        return None
    others = sum(int(c["pending"]) for c in pending.get("consumers") or []
                 if c["name"] != consumer.encode())
    return int(lag) + others


# The trim of module doc point 1, run atomically in one round trip. Ids "ms-seq" are
# compared as digit strings (no leading zeros: longer is larger), never as Lua doubles.
_TRIM_ACKED = """
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
if not ok then return 0 end
local function less(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if #am ~= #bm then return #am < #bm end
  if am ~= bm then return am < bm end
  if #as ~= #bs then return #as < #bs end
  return as < bs
end
local threshold = nil
for _, g in ipairs(groups) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  local floor = info['last-delivered-id']
  if info['pending'] > 0 then
    local summary = redis.call('XPENDING', KEYS[1], info['name'])
    if summary[2] then floor = summary[2] end
  end
  if threshold == nil or less(floor, threshold) then threshold = floor end
end
if threshold ~= nil then
  if ARGV[1] == '1' then
    redis.call('XTRIM', KEYS[1], 'MINID', threshold)
  else
    redis.call('XTRIM', KEYS[1], 'MINID', '~', threshold)
  end
end
return redis.call('XLEN', KEYS[1])
"""


_TRIM_SHA = hashlib.sha1(_TRIM_ACKED.encode()).hexdigest()  # the name EVALSHA knows it by


def trim_acknowledged(client: redis.Redis, stream: str, *, exact: bool) -> int:
    """Delete entries every consumer group of ``stream`` has acknowledged (one Lua script).

    Returns:
        The stream length afterwards (0 when the stream does not exist).
    """
    script = client.register_script(_TRIM_ACKED)
    return int(script(keys=[stream], args=["1" if exact else "0"]))


class RoomTokens:
    """Wake-ups for writers waiting at a stream's cap: a list ``<stream>:room`` of tokens.

    The reader pushes a token per :attr:`grant` entries it acknowledges (in the round trip
    of the ``XACK``); a writer at the cap waits in ``BLPOP`` on the list, which hands each
    token to the writer that waited longest, and may then add ``grant`` chunks. Tokens
    are hints (a woken writer still trims and reads the length; the list holds ``cap /
    grant`` at most). A user whose ACL lacks ``BLPOP`` / ``RPUSH`` / ``LTRIM`` (or the key)
    gets one warning, then writers poll.

    Args:
        stream: the chunk stream.
        cap: the stream's ``max_len``.
    """

    def __init__(self, stream: str, cap: int) -> None:
        self.stream, self.key = stream, f"{stream}:room"
        # Adds per token: 4 on streams of 32 entries and more (fewer wake-ups a chunk),
        # less on short ones, where a grant would be a large part of the stream.
        self.grant = max(1, min(4, cap // 8))
        self.cap = max(1, cap // self.grant)  # tokens kept at most
        self.enabled = True

    def queue(self, pipe: Any, freed: int) -> int:
        """Queue on ``pipe`` the tokens for ``freed`` acknowledged entries; how many
        commands were queued (their replies go to :meth:`check`)."""
        if not self.enabled or freed <= 0:
            return 0
        pipe.rpush(self.key, *([b"1"] * min(-(-freed // self.grant), self.cap)))
        pipe.ltrim(self.key, -self.cap, -1)  # stale tokens stay bounded
        return 2

    def check(self, replies: list[Any]) -> None:
        """Look at the replies of :meth:`queue`'s commands (``raise_on_error=False``):
        a refusal by the ACL turns tokens off.

        Raises:
            redis.RedisError: any other error among them.
        """
        for reply in replies:
            if isinstance(reply, redis.exceptions.NoPermissionError):
                self._refused(reply)
            elif isinstance(reply, Exception):
                raise reply

    def wait_then_trim(self, client: redis.Redis, timeout_s: float) -> int | None:
        """Block until a token comes or ``timeout_s`` passes (at least 1 ms: ``BLPOP 0``
        blocks for ever), then :func:`trim_acknowledged` exactly, in one round trip; the
        stream's length after it, or None without waiting when tokens are off (or the ACL
        just refused them).

        Raises:
            redis.ConnectionError / redis.TimeoutError: the connection failed.
            redis.RedisError: Redis refused a command for another reason than the ACL.
        """
        if not self.enabled:
            return None
        pipe = client.pipeline(transaction=False)
        pipe.blpop([self.key], timeout=round(max(timeout_s, 0.001), 3))
        pipe.evalsha(_TRIM_SHA, 1, self.stream, "1")  # not a Script: a pipeline asks SCRIPT EXISTS first
        token, length = pipe.execute(raise_on_error=False)
        if isinstance(token, redis.exceptions.NoPermissionError):
            self._refused(token)
            return None
        if isinstance(length, redis.exceptions.NoScriptError):  # a restarted server: load it
            return trim_acknowledged(client, self.stream, exact=True)
        for reply in (token, length):
            if isinstance(reply, Exception):
                raise reply
        return int(length)

    def _refused(self, exc: Exception) -> None:
        if self.enabled:
            logger.warning("redis: waiting for room by polling (%s): grant the user +blpop +rpush +ltrim on "
                           "%r to let writers wait without polling (docs/multi-machine.md)",
                           _first_line(exc), self.key)
        self.enabled = False


class XaddPacker:
    """``XADD stream * field <chunk>`` then ``XLEN stream`` as one RESP packet, the chunk
    encoded straight into it (one copy; redis-py's packer would copy it again).

    Args:
        stream: the stream key (encoded as redis-py encodes ``str``: UTF-8).
        field: the entry's field name.
    """

    def __init__(self, stream: str, field: bytes) -> None:
        self._key, self._field = stream.encode("utf-8"), field
        self._frames: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # by chunk size

    def _tail(self) -> bytes:
        return b"\r\n*2\r\n$4\r\nXLEN\r\n$%d\r\n%s\r\n" % (len(self._key), self._key)

    def packet(self, enc: Encoding | PackedEncoding) -> memoryview:
        """A new packet holding ``enc`` (kept by the writer until both replies are read).

        Raises:
            SpecMismatchError: from :meth:`Encoding.write_into`.
        """
        frames = self._frames.get(enc.nbytes)
        if frames is None:
            def bulk(b: bytes) -> bytes:
                return b"$%d\r\n%s\r\n" % (len(b), b)

            prefix = b"*5\r\n" + bulk(b"XADD") + bulk(self._key) + bulk(b"*") + bulk(self._field)
            prefix += b"$%d\r\n" % enc.nbytes
            frames = self._frames[enc.nbytes] = (np.frombuffer(prefix, np.uint8),
                                                 np.frombuffer(self._tail(), np.uint8))
        head, tail = frames
        end = len(head) + enc.nbytes
        packet = np.empty(end + len(tail), np.uint8)  # every byte is written below
        packet[:len(head)] = head
        enc.write_into(packet[len(head):end])
        packet[end:] = tail
        return packet.data


class HintChannel:
    """A pub/sub channel read as hints: messages may be lost, so callers also poll.

    Args:
        link: the connection to use (its client opens a separate pub/sub connection).
        channel: the channel name.
    """

    def __init__(self, link: RedisLink, channel: str) -> None:
        self._link = link
        self._channel = channel
        self._pubsub: Any = None

    def wait(self, timeout_s: float) -> bool:
        """True when a message arrived within ``timeout_s`` (or the channel broke: look anyway)."""
        try:
            if self._pubsub is None:
                self._pubsub = self._link.client.pubsub(ignore_subscribe_messages=True)
                self._pubsub.subscribe(self._channel)
                return True  # messages before the subscription are lost: look now
            got = False
            msg = self._pubsub.get_message(timeout=max(timeout_s, 0.0))
            while msg is not None:
                got = got or msg.get("type") == "message"
                msg = self._pubsub.get_message(timeout=0.0)
            return got
        except (redis.ConnectionError, redis.TimeoutError):
            self.close()  # resubscribe on the next call
            return True

    def publish(self, message: bytes | str) -> None:
        """Send a hint; failures are ignored (hints are optional)."""
        with contextlib.suppress(redis.RedisError):
            self._link.client.publish(self._channel, message)

    def close(self) -> None:
        """Drop the subscription."""
        if self._pubsub is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                self._pubsub.close()
            self._pubsub = None


def check_reachable(url: str, timeout_s: float = 5.0) -> None:
    """Ping the Redis server of ``url`` once, waiting ``timeout_s`` at most.

    Raises:
        TransportError: no answer ("cannot reach redis at host:port ..."), the password
            refused (naming where it came from, and where to give it), or the server refused
            the ping.
        ConfigError: a malformed URL.
    """
    link = RedisLink(url, socket_timeout_s=timeout_s)
    try:
        link.client.ping()
    except redis.AuthenticationError as exc:  # a ConnectionError too: not "unreachable"
        raise TransportError(f"redis at {_address(url)} refused the connection ({_first_line(exc)}) with "
                             f"{password_source()}: give its password with --redis-password-file FILE or "
                             f"${ENV} (a resumed run's URL holds none)") from None
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise TransportError(f"cannot reach redis at {_address(url)} ({_first_line(exc)}): start "
                             f"redis-server there or give the right URL") from None
    except redis.RedisError as exc:
        raise TransportError(f"redis at {_address(url)} refused a ping: {_first_line(exc)}") from None
    finally:
        link.close()


def _address(url: str) -> str:
    """``host:port`` (or the socket path) of a Redis URL."""
    parsed = urlparse(url)
    if parsed.scheme == "unix":
        return parsed.path
    return f"{parsed.hostname or 'localhost'}:{parsed.port or 6379}"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
