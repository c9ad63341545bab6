"""``redis://`` transport: Redis streams read through a consumer group.

The one importer of redis (:class:`RedisLink` serves the policy backend too). Chunks are
entries ``{d: <encoded chunk>}`` of one stream read by one group: at-least-once delivery.
How entries are read, re-read, claimed and de-duplicated, and back-pressure without losing
data (only acknowledged entries are trimmed, :func:`trim_acknowledged`; writers wait for
:class:`RoomTokens`): docs/transports.md, "redis://". A lost connection is retried with
backoff until the caller's deadline, then raised as
:class:`~shardreplay.errors.TransportTimeout`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, TypeVar
from urllib.parse import urlparse

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shardreplay.errors import ConfigError, TransportError, TransportTimeout
from shardreplay.secrets import ENV, connect_args, password_source, redact
from shardreplay.spec import Spec
from shardreplay.transport.base import (
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_SEND_TIMEOUT_S,
    DUPLICATE,
    Backlog,
    IntakeReader,
)
from shardreplay.transport.codec import Chunk, Encoding, PackedEncoding, check_codec, wire_encoding

__all__ = ["HintChannel", "RedisLink", "RedisReader", "RedisTransport", "RedisWriter", "RoomTokens",
           "XaddPacker", "check_reachable", "trim_acknowledged"]

logger = logging.getLogger("shardreplay.transport")
T = TypeVar("T")
_FIELD = b"d"
_ACK_BATCH = 256
_POLL_CAP_S = 0.005  # a writer without room tokens looks this often at most
# With tokens, a look every 3 s covers a token lost on the way; a writer that times out
# loses its place in line, so this is longer than a turn in line at 128 writers (shorter
# looks made the writers' rates unfair: RESULTS-ingest.md).
_TOKEN_WAIT_S = 3.0


class RedisTransport:
    """Chunks through the Redis stream ``stream`` of ``url`` read by consumer group
    ``group``, as ``consumer`` (keep it stable across restarts, one per learner rank, so a
    restarted reader re-reads its own pending entries). Writers wait while the stream
    holds ``max_len`` entries; entries pending ``claim_idle_s`` at another consumer are
    taken over; a reader raises once the server is gone ``reconnect_timeout_s``, and
    trims acknowledged entries every ``trim_interval_s``. ``max_chunk_bytes``,
    ``dedup_window`` and ``compression``: as for :class:`~.local.LocalTransport` and
    :class:`~.spool.SpoolTransport`.

    Raises:
        ConfigError: a bad setting or URL.
    """

    def __init__(self, url: str, spec: Spec, *, stream: str = "shardreplay:chunks",
                 group: str = "learners", consumer: str = "learner", max_len: int = 1000,
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, dedup_window: int = 4096,
                 claim_idle_s: float = 60.0, reconnect_timeout_s: float = 60.0,
                 trim_interval_s: float = 0.1, socket_timeout_s: float = 5.0,
                 compression: str = "none") -> None:
        if max_len < 1:
            raise ConfigError(f"max_len must be >= 1, got {max_len}")
        if claim_idle_s <= 0 or reconnect_timeout_s <= 0 or socket_timeout_s <= 0:
            raise ConfigError("claim_idle_s, reconnect_timeout_s and socket_timeout_s must be > 0")
        self._url = url  # may hold a password: only for connecting
        self.url, self.spec = redact(url), spec  # what messages show
        self.stream, self.group, self.consumer = stream, group, consumer
        self.compression = check_codec(compression)
        self.max_len = max_len
        self.max_chunk_bytes, self.dedup_window = max_chunk_bytes, dedup_window
        self.claim_idle_s, self.reconnect_timeout_s = claim_idle_s, reconnect_timeout_s
        self.trim_interval_s, self.socket_timeout_s = trim_interval_s, socket_timeout_s
        RedisLink(url, socket_timeout_s=socket_timeout_s).close()  # validates the URL early

    def link(self) -> RedisLink:
        """A new connection to this transport's server."""
        return RedisLink(self._url, socket_timeout_s=self.socket_timeout_s)

    def channel(self, shard: int, run_id: str = "") -> str:
        """The stream of ``shard``'s chunks: ``shardreplay:<run_id>:chunks:<k>``
        (``shardreplay:chunks:<k>`` without a run id)."""
        return f"shardreplay:{run_id}:chunks:{shard}" if run_id else f"shardreplay:chunks:{shard}"

    def channels(self, shard: int) -> list[str]:
        """The chunk streams of ``shard`` on the server, of every run (``SCAN``).

        Raises:
            TransportError / TransportTimeout: the server could not be asked.
        """
        def scan(r: Any) -> list[str]:
            return sorted({key.decode() if isinstance(key, bytes) else str(key)
                           for pattern in (self.channel(shard), self.channel(shard, "*"))
                           for key in r.scan_iter(match=pattern, _type="stream")})

        return self._ask(scan, "SCAN chunk streams")

    def backlog(self, channel: str | None = None) -> Backlog:
        """Entries of stream ``channel`` (None: this transport's) some consumer group has
        not acknowledged (pending plus ``lag``); the stream's length where Redis cannot tell
        that (no group, a server before Redis 7: an upper bound). Bytes are not reported.

        Raises:
            TransportError / TransportTimeout: the server could not be asked.
        """
        stream = self.stream if channel is None else channel
        return Backlog(self._ask(lambda r: _unconsumed(r, stream), f"XINFO {stream}"), None)

    def _ask(self, fn: Callable[[Any], T], what: str) -> T:
        """``fn(client)`` on a new connection, retried for 10 s at most."""
        link = self.link()
        try:
            return link.call(fn, what=what, deadline=time.monotonic() + 10.0)
        finally:
            link.close()

    def writer(self) -> RedisWriter:
        """A writer end; call it in the actor process."""
        return RedisWriter(self)

    def reader(self) -> RedisReader:
        """A reader end named ``consumer``; call it in the learner process.

        Raises:
            TransportTimeout: the server is unreachable for ``reconnect_timeout_s``.
        """
        return RedisReader(self)


def _unconsumed(r: Any, stream: str) -> int:
    length = int(r.xlen(stream))
    groups = r.xinfo_groups(stream) if length else []
    if not groups or any(group.get("lag") is None for group in groups):
        return length
    return min(max(int(group["pending"]) + int(group["lag"]) for group in groups), length)


class RedisWriter:
    """Actor end of a :class:`RedisTransport`; its adds are pipelined (docs/transports.md,
    "redis://")."""

    #: Adds in flight at most (an actor killed with them sent may not have delivered them).
    MAX_IN_FLIGHT = 8

    def __init__(self, transport: RedisTransport) -> None:
        self._t = transport
        self._link = transport.link()
        self._has_group = False
        self._length: int | None = None  # the stream's length when this writer last looked
        self._sent: deque[memoryview] = deque()  # packets whose replies are not read yet, oldest first
        self._conn: Any = None
        self._broken = False  # the connection failed with adds in flight: re-send them
        self._packer = XaddPacker(transport.stream, _FIELD)
        self._room = RoomTokens(transport.stream, transport.max_len)
        # None: add while the stream's length allows; else adds left before this writer
        # queues for a room token again (it is in line while the stream is over half full).
        self._credit: int | None = None

    def send(self, chunk: Chunk, *, timeout_s: float | None = DEFAULT_SEND_TIMEOUT_S) -> None:
        """Encode ``chunk`` and add it, waiting while the stream holds ``max_len`` entries.

        Raises:
            SpecMismatchError: the chunk does not fit the spec.
            TransportTimeout: no room, or no server, within ``timeout_s``.
            TransportError: Redis refused the write.
        """
        t = self._t
        enc = wire_encoding(chunk, t.spec, t.compression)
        data = self._packer.packet(enc)  # XADD + XLEN around the chunk, encoded in place
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._has_group:
            self._link.call(lambda r: ensure_group(r, t.stream, t.group), what="XGROUP CREATE",
                            deadline=deadline)
            self._has_group = True
        while True:
            full = self._length is None or self._length + len(self._sent) >= t.max_len
            if len(self._sent) >= self.MAX_IN_FLIGHT or (self._sent and full and self._credit is None):
                self._settle(deadline)  # the replies say the length after our adds
            elif full or self._credit == 0:
                self._length = self._wait_for_room(deadline, timeout_s)
            else:
                break
        self._sent.append(data)
        if self._credit is not None:
            self._credit -= 1
        if not self._broken:
            try:
                self._push(data)
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                self._broken = True
        if self._broken:  # replies are otherwise read 8 adds at a time, by the loop above
            self._settle(deadline)

    @property
    def in_flight(self) -> int:
        """How many of the chunks sent last are not confirmed yet (their replies not read):
        a process killed now may not have delivered them (its connection may be dead)."""
        return len(self._sent)

    def flush(self, timeout_s: float | None = DEFAULT_SEND_TIMEOUT_S) -> None:
        """Wait until every chunk sent is confirmed by the server.

        Raises:
            TransportTimeout: no server within ``timeout_s``.
            TransportError: Redis refused a write.
        """
        self._settle(None if timeout_s is None else time.monotonic() + timeout_s)

    def _connection(self) -> Any:
        if self._conn is None:
            self._conn = self._link.client.connection_pool.get_connection()
        return self._conn

    def _push(self, data: memoryview) -> None:
        self._connection().send_packed_command([data])  # XADD then XLEN, one send

    def _settle(self, deadline: float | None) -> None:
        def settle(_: redis.Redis) -> None:
            conn = self._connection()
            try:
                if self._broken:
                    conn.disconnect()
                    for data in self._sent:
                        self._push(data)
                    self._broken = False
                while self._sent:
                    conn.read_response()  # the entry id
                    self._length = int(conn.read_response())
                    self._sent.popleft()
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                self._broken = True
                raise redis.ConnectionError(str(exc)) from exc
            except redis.RedisError:
                self._broken = True  # replies out of step: re-send the rest on a new connection
                raise

        if self._sent or self._broken:
            self._link.call(settle, what="XADD", deadline=deadline)

    def _wait_for_room(self, deadline: float | None, timeout_s: float | None) -> int:
        """Free what every group has acknowledged until the stream is below ``max_len``
        (a writer in line, see ``_credit``, first waits for a room token); its length then."""
        t, pause = self._t, 0.0005
        in_line = self._credit is not None and self._room.enabled
        while True:
            n = self._look(deadline, in_line)
            # Our adds in flight count as not yet in ``n`` (those the server did take
            # count twice: a stricter cap, never a looser one).
            if n + len(self._sent) < t.max_len:
                # Over half full: ``grant`` adds per token from now on, so that the
                # writers waiting take the freed entries in turn (FIFO in BLPOP) instead
                # of the first one woken taking them all with its window of adds.
                self._credit = self._room.grant if n > t.max_len // 2 and self._room.enabled else None
                return n
            if deadline is not None and deadline <= time.monotonic():
                raise TransportTimeout(f"redis stream {t.stream!r} held {n} unacknowledged entries "
                                       f"(max_len={t.max_len}) for {timeout_s} s: the learner is not "
                                       "draining it (is it alive?)")
            if self._sent:  # maybe only our own adds, counted twice: confirm them, look again
                self._settle(deadline)
                in_line = False
                continue
            in_line = self._room.enabled
            if not in_line:  # no tokens (ACL): poll, as before them
                time.sleep(pause if deadline is None else max(min(pause, deadline - time.monotonic()), 0.0))
                pause = min(pause * 2, _POLL_CAP_S)

    def _look(self, deadline: float | None, in_line: bool) -> int:
        """Trim what is acknowledged and return the stream's length; ``in_line``: first
        wait for a room token (``_TOKEN_WAIT_S`` at most), in the same round trip."""
        t = self._t
        n: int | None = None
        if in_line:
            left = _TOKEN_WAIT_S if deadline is None else deadline - time.monotonic()
            wait = min(_TOKEN_WAIT_S, left, t.socket_timeout_s / 2)
            n = self._link.call(lambda r: self._room.wait_then_trim(r, wait), what="BLPOP", deadline=deadline)
        if n is None:  # not in line, or tokens refused by the ACL
            n = self._link.call(lambda r: trim_acknowledged(r, t.stream, exact=True), what="XTRIM",
                                deadline=deadline)
        return n

    def close(self) -> None:
        """Wait (up to ``socket_timeout_s``) for the chunks in flight, then close; one the
        server could not confirm by then is logged, not raised."""
        try:
            self.flush(self._t.socket_timeout_s)
        except (TransportTimeout, TransportError) as exc:
            logger.warning("redis %s: %d chunks sent but not confirmed at close: %s", self._t.url,
                           len(self._sent), exc)
        if self._conn is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                self._conn.disconnect()
            self._conn = None
        self._link.close()


class RedisReader(IntakeReader):
    """Learner end of a :class:`RedisTransport`."""

    def __init__(self, transport: RedisTransport) -> None:
        t = self._t = transport
        self._link = transport.link()
        super().__init__(t.spec, t.max_chunk_bytes, t.dedup_window, f"redis {t.url} {t.stream}")
        self._inflight: dict[tuple[int, int], bytes] = {}
        self._inflight_ids: set[bytes] = set()
        self._to_ack: list[bytes] = []
        # Entries refused and not yet acknowledged: a re-read of our pending list (after a
        # retried call or a reconnect) returns them again before the queued XACK goes out.
        self._refused: set[bytes] = set()
        self._room = RoomTokens(t.stream, t.max_len)  # wakes writers waiting for what we ack
        self._pending_cursor: bytes | None = b"0"  # re-read our own pending entries first
        self._claim_cursor: bytes = b"0-0"
        self._last_claim = self._last_trim = time.monotonic()
        self._waiting = 0  # entries a server restart would lose, at the last look
        deadline = time.monotonic() + t.reconnect_timeout_s
        self._link.call(lambda r: ensure_group(r, t.stream, t.group), what="XGROUP CREATE", deadline=deadline)
        self._run_id = self._link.call(_run_id, what="INFO", deadline=deadline)

    def _receive(self, max_chunks: int, deadline: float, borrow: bool) -> list[Chunk]:
        out: list[Chunk] = []
        try:
            while True:
                for entry_id, fields in self._fetch(max_chunks - len(out), deadline):
                    self._take(entry_id, fields, out)
                self._maybe_trim(deadline)
                if out or time.monotonic() >= deadline:
                    return out
        except TransportTimeout:
            if self._link.down_for_s() >= self._t.reconnect_timeout_s:
                raise
            return out

    def _fetch(self, count: int, deadline: float) -> list[tuple[bytes, dict[bytes, bytes] | None]]:
        t = self._t
        if self._pending_cursor is not None:
            cursor = self._pending_cursor
            entries = _stream_entries(self._group_call(
                lambda r: r.xreadgroup(t.group, t.consumer, {t.stream: cursor}, count=count),
                "XREADGROUP 0", deadline))
            self._pending_cursor = entries[-1][0] if entries else None
            return entries
        now = time.monotonic()
        if now - self._last_claim >= max(t.claim_idle_s / 2, 0.05):
            self._last_claim = now
            cursor, idle_ms = self._claim_cursor, int(t.claim_idle_s * 1000)
            claim: list[Any] = self._delivering_call(
                lambda r: r.xautoclaim(t.stream, t.group, t.consumer, idle_ms, cursor, count=count),
                "XAUTOCLAIM", deadline)
            self._claim_cursor = claim[0]  # RESP2: [next cursor, entries, deleted ids]
            if claim[1]:
                self._waiting = max(self._waiting - len(claim[1]), 0)  # no longer at a dead consumer
                return [(eid, fields) for eid, fields in claim[1]]
        block_ms = int(min(max(deadline - now, 0.0), 1.0, t.socket_timeout_s / 2) * 1000)
        acks = list(self._to_ack)
        # Half the stream at most: what we hold unacknowledged counts against max_len, so
        # taking all of it would leave the writers no room until our next read (they
        # refill one half while we store the other).
        count = min(count, max(1, t.max_len // 2))

        def ack_and_read(r: redis.Redis) -> Any:
            pipe = r.pipeline(transaction=False)
            tokens = 0
            if acks:
                pipe.xack(t.stream, t.group, *acks)
                tokens = self._room.queue(pipe, len(acks))
            pipe.xreadgroup(t.group, t.consumer, {t.stream: ">"}, count=count, block=block_ms or None)
            return self._replies(pipe, tokens)[-1]

        entries = _stream_entries(self._delivering_call(ack_and_read, "XREADGROUP >", deadline))
        del self._to_ack[:len(acks)]
        self._refused.difference_update(acks)
        self._waiting = max(self._waiting - len(entries), 0)  # delivered: no longer waiting
        return entries

    def _replies(self, pipe: Any, tokens: int) -> list[Any]:
        """Run ``pipe``, whose ``tokens`` commands after the first are room tokens (the ACL
        refusing those turns tokens off); any other error is raised."""
        replies = pipe.execute(raise_on_error=False)
        for i, reply in enumerate(replies):
            if 1 <= i <= tokens and isinstance(reply, redis.exceptions.NoPermissionError):
                self._room.refuse(reply)
            elif isinstance(reply, Exception):
                raise reply
        return replies[:1] + replies[1 + tokens:]

    def _delivering_call(self, fn: Callable[[redis.Redis], T], what: str, deadline: float) -> T:
        """:meth:`_group_call` of a command that moves entries into our pending list
        (``XREADGROUP >``, ``XAUTOCLAIM``): sent again after a lost reply, it may have
        delivered entries we never saw, so the next fetch re-reads our pending list."""
        failed = self._link.failed_calls
        result = self._group_call(fn, what, deadline)
        if self._link.failed_calls != failed:
            self._pending_cursor = b"0"
        return result

    def _group_call(self, fn: Callable[[redis.Redis], T], what: str, deadline: float) -> T:
        """``fn(client)``; if the group vanished (a server restarted without its data),
        recreate it, count what was lost (:meth:`_group_recreated`) and run ``fn`` again."""
        t = self._t

        def run(r: redis.Redis) -> T:
            try:
                return fn(r)
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):  # redis reports a missing group only in the message
                    raise
                logger.warning("redis: group %r of stream %r was missing; recreated at id 0", t.group,
                               t.stream)
                ensure_group(r, t.stream, t.group)
                self._group_recreated(r)
                return fn(r)

        return self._link.call(run, what=what, deadline=deadline)

    def _group_recreated(self, client: redis.Redis) -> None:
        """The group was missing: if the server restarted (a new run id), count what
        waited in it at the last look as lost."""
        run_id = _run_id(client)
        if run_id == self._run_id:  # the group was deleted by hand; the entries are still there
            return
        self._run_id, self._claim_cursor = run_id, b"0-0"
        self._lose(self._waiting, f"redis-server {self._t.url} restarted without its data; "
                          f"{self._waiting} entries of {self._t.stream!r} were waiting at the last look "
                          f"(every {self._t.trim_interval_s} s; those added since are not counted). "
                          "Run a production Redis with appendonly yes")
        self._waiting = 0

    def _take(self, entry_id: bytes, fields: dict[bytes, bytes] | None, out: list[Chunk]) -> None:
        if entry_id in self._refused:  # refused once already: counted then, its XACK is queued
            return
        data = fields.get(_FIELD) if fields else None
        if data is None:
            if fields:  # an entry someone else wrote; never ours
                self._reject("malformed_entry", f"entry {entry_id!r} has fields {list(fields)[:4]}")
                self._refused.add(entry_id)
            self._to_ack.append(entry_id)  # else: deleted while pending; nothing to deliver
            return
        result = self._admit(data, f"entry {entry_id.decode()}")
        if isinstance(result, Chunk):
            self._inflight[result.identity] = entry_id
            self._inflight_ids.add(entry_id)
            out.append(result)
        elif not (result == DUPLICATE and entry_id in self._inflight_ids):
            self._to_ack.append(entry_id)  # rejected or an extra copy: never deliver again
            if result != DUPLICATE:
                self._refused.add(entry_id)

    def ack(self, chunks: Iterable[Chunk]) -> None:
        """Queue the ``XACK`` of stored chunks; it goes out with the next read (or at ``close``)."""
        for chunk in chunks:
            entry_id = self._inflight.pop(chunk.identity, None)
            if entry_id is not None:
                self._inflight_ids.discard(entry_id)
                self._to_ack.append(entry_id)
                self.stats.acked += 1
        if len(self._to_ack) >= _ACK_BATCH:
            self.flush()

    def flush(self) -> None:
        """Send queued acknowledgements now (kept for later if the server is away)."""
        t = self._t
        if not self._to_ack:
            return
        ids = list(self._to_ack)

        def ack(r: redis.Redis) -> None:
            pipe = r.pipeline(transaction=False)
            pipe.xack(t.stream, t.group, *ids)
            self._replies(pipe, self._room.queue(pipe, len(ids)))

        try:
            self._link.call(ack, what="XACK", deadline=time.monotonic())
        except TransportTimeout:
            logger.warning("redis %s: %d acknowledgements wait for the server", t.url, len(ids))
            return
        del self._to_ack[:len(ids)]
        self._refused.difference_update(ids)

    def _maybe_trim(self, deadline: float) -> None:
        t = self._t
        if time.monotonic() - self._last_trim >= t.trim_interval_s:
            self._last_trim = time.monotonic()
            try:
                waiting = self._link.call(lambda r: (trim_acknowledged(r, t.stream, exact=False),
                                                     waiting_entries(r, t.stream, t.group, t.consumer))[1],
                                          what="XTRIM", deadline=deadline)
                if waiting is not None:
                    self._waiting = waiting
            except TransportTimeout:
                raise
            except TransportError as exc:  # e.g. a group vanished mid-way: trimming can wait
                logger.warning("redis %s: trimming %r failed: %s", t.url, t.stream, exc)

    def close(self) -> None:
        """Send queued acknowledgements and close; unacknowledged entries stay pending."""
        self.flush()
        self._link.close()


def _stream_entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes] | None]]:
    """The entries of a one-stream ``XREADGROUP`` reply (``[[stream, entries]]`` or None;
    bytes, as the link's client does not decode). A deleted entry has fields None."""
    return list(reply[0][1]) if reply else []


def _run_id(client: redis.Redis) -> str:
    """The server's run id: a new one after every restart."""
    return str(client.info("server").get("run_id", ""))


# -- connections, groups, trimming, room tokens, packets, hints ----------------------------

class RedisLink:
    """One Redis client of ``url`` (``redis://``, ``rediss://``, ``unix://``) whose calls
    reconnect on failure and raise shardreplay errors (a malformed URL: ConfigError)."""

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
    """Delete entries every consumer group of ``stream`` has acknowledged (one Lua script);
    the stream's length afterwards (0 when there is no stream)."""
    script = client.register_script(_TRIM_ACKED)
    return int(script(keys=[stream], args=["1" if exact else "0"]))


class RoomTokens:
    """Wake-ups for writers waiting at the cap ``cap`` of ``stream``: the list
    ``<stream>:room`` (docs/transports.md, "redis://")."""

    def __init__(self, stream: str, cap: int) -> None:
        self.stream, self.key = stream, f"{stream}:room"
        # Adds per token: 4 on streams of 32 entries and more (fewer wake-ups a chunk),
        # less on short ones, where a grant would be a large part of the stream.
        self.grant = max(1, min(4, cap // 8))
        self.cap = max(1, cap // self.grant)  # tokens kept at most
        self.enabled = True

    def queue(self, pipe: Any, freed: int) -> int:
        """Queue on ``pipe`` the tokens for ``freed`` acknowledged entries; how many
        commands were queued."""
        if not self.enabled or freed <= 0:
            return 0
        pipe.rpush(self.key, *([b"1"] * min(-(-freed // self.grant), self.cap)))
        pipe.ltrim(self.key, -self.cap, -1)  # stale tokens stay bounded
        return 2

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
            self.refuse(token)
            return None
        if isinstance(length, redis.exceptions.NoScriptError):  # a restarted server: load it
            return trim_acknowledged(client, self.stream, exact=True)
        for reply in (token, length):
            if isinstance(reply, Exception):
                raise reply
        return int(length)

    def refuse(self, exc: Exception) -> None:
        """Turn tokens off (the ACL refused them: ``exc``), with one warning."""
        if self.enabled:
            logger.warning("redis: waiting for room by polling (%s): grant the user +blpop +rpush +ltrim on "
                           "%r to let writers wait without polling (docs/multi-machine.md)",
                           _first_line(exc), self.key)
        self.enabled = False


class XaddPacker:
    """``XADD stream * field <chunk>`` then ``XLEN stream`` as one RESP packet, the chunk
    encoded straight into it (one copy; redis-py's packer would copy it again). The key is
    UTF-8, as redis-py encodes a ``str``."""

    def __init__(self, stream: str, field: bytes) -> None:
        self._key, self._field = stream.encode("utf-8"), field
        self._frames: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # by chunk size

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
            after = b"\r\n*2\r\n" + bulk(b"XLEN") + bulk(self._key)
            frames = self._frames[enc.nbytes] = (np.frombuffer(prefix, np.uint8),
                                                 np.frombuffer(after, np.uint8))
        head, tail = frames
        end = len(head) + enc.nbytes
        packet = np.empty(end + len(tail), np.uint8)  # every byte is written below
        packet[:len(head)] = head
        enc.write_into(packet[len(head):end])
        packet[end:] = tail
        return packet.data


class HintChannel:
    """Pub/sub ``channel`` over ``link`` (a connection of its own), read as hints:
    messages may be lost, so callers also poll."""

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
