"""The redis transport against a real redis-server: groups, re-delivery, back-pressure, restarts."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import numpy as np
import pytest
import redis

from shardreplay.errors import TransportTimeout
from shardreplay.spec import Field, Spec
from shardreplay.transport import open_transport
from shardreplay.transport.codec import encode
from shardreplay.transport.redis import RedisTransport, trim_acknowledged
from tests.transport.transport_helpers import SPEC, assert_same_chunk, make_chunk, receive_all, send_chunks

pytestmark = pytest.mark.redis
STREAM = "shardreplay:chunks"


def make(server, **options) -> RedisTransport:
    transport = open_transport(server.url, SPEC, **options)
    assert isinstance(transport, RedisTransport)
    return transport


def client(server) -> redis.Redis:
    return redis.Redis.from_url(server.url)


def test_round_trip(redis_server) -> None:
    transport = make(redis_server)
    writer, reader = transport.writer(), transport.reader()
    sent = [make_chunk(a, q, priorities=q == 1) for a in (0, 5) for q in range(3)]
    for c in sent:
        writer.send(c)
    got = receive_all(reader, 6, timeout_s=5)
    assert sorted(c.identity for c in got) == sorted(c.identity for c in sent)
    for c in got:
        assert_same_chunk(c, make_chunk(c.actor_id, c.sequence, priorities=c.sequence == 1))
    assert reader.receive(10, timeout_s=0.05) == []  # its read carries the queued XACKs
    assert client(redis_server).xpending(STREAM, "learners")["pending"] == 0


def test_restarted_reader_rereads_unacknowledged_entries_only(redis_server) -> None:
    transport = make(redis_server)
    writer = transport.writer()
    for q in range(3):
        writer.send(make_chunk(0, q))
    reader = transport.reader()
    first = reader.receive(10, timeout_s=1)
    assert [c.sequence for c in first] == [0, 1, 2]
    reader.ack(first[:1])
    reader.close()  # dies without acknowledging 1 and 2
    writer.send(make_chunk(0, 3))
    again = transport.reader()
    got = receive_all(again, 3, timeout_s=5)
    assert [c.sequence for c in got] == [1, 2, 3]  # pending first, then new; 0 never again
    again.close()
    assert transport.reader().receive(10, timeout_s=0.2) == []


def test_a_read_whose_reply_was_lost_is_read_again_at_once(redis_server, monkeypatch) -> None:
    """The server ran ``XREADGROUP >`` (the entry is now pending at this reader) but the reply
    never came (a socket timeout, a server killed before answering): the reader's retry
    reads only new entries, so it must look at its own pending list again, not wait
    ``claim_idle_s`` (60 s) for XAUTOCLAIM. Found by the Redis fault matrix (an actor's
    chunk missing after a redis-server SIGKILL); this test lost the entry for 60 s before."""
    from redis.client import Pipeline

    transport = make(redis_server, claim_idle_s=60.0)
    writer, reader = transport.writer(), transport.reader()
    assert reader.receive(10, timeout_s=0.2) == []  # its start-up re-read of pending entries
    writer.send(make_chunk(0, 0))
    execute, lost = Pipeline.execute, []

    def reply_lost_once(self, *args, **kwargs):
        replies = execute(self, *args, **kwargs)  # the server ran it
        if not lost:
            lost.append(replies)
            raise redis.ConnectionError("reply lost (test)")
        return replies

    monkeypatch.setattr(Pipeline, "execute", reply_lost_once)
    got = receive_all(reader, 1, timeout_s=5)
    assert lost and [c.sequence for c in got] == [0]
    assert reader.receive(10, timeout_s=0.2) == []  # once: no duplicate (receive_all acknowledged it)
    assert reader.receive(10, timeout_s=0.05) == []  # that read carried the XACK
    assert client(redis_server).xpending(STREAM, "learners")["pending"] == 0


def test_entries_left_by_a_dead_consumer_are_claimed(redis_server) -> None:
    writer = make(redis_server).writer()
    for q in range(2):
        writer.send(make_chunk(0, q))
    dead = make(redis_server, consumer="rank0").reader()
    assert len(dead.receive(10, timeout_s=1)) == 2
    dead.close()
    heir = make(redis_server, consumer="rank1", claim_idle_s=0.2).reader()
    time.sleep(0.3)
    got = receive_all(heir, 2, timeout_s=5)
    assert sorted(c.sequence for c in got) == [0, 1]


def test_duplicates_are_dropped_and_acknowledged(redis_server) -> None:
    transport = make(redis_server)
    writer, reader = transport.writer(), transport.reader()
    writer.send(make_chunk(2, 0))
    writer.send(make_chunk(2, 0))  # a retried XADD whose first reply was lost
    writer.send(make_chunk(2, 1))
    got = receive_all(reader, 2, timeout_s=5)
    assert [c.sequence for c in got] == [0, 1]
    assert reader.receive(10, timeout_s=0.1) == []
    assert reader.stats.duplicates == 1
    reader.flush()
    assert client(redis_server).xpending(STREAM, "learners")["pending"] == 0


def test_malformed_entries_are_rejected_counted_and_acknowledged(redis_server) -> None:
    transport = make(redis_server, max_chunk_bytes=4096)
    reader = transport.reader()
    r = client(redis_server)
    good = encode(make_chunk(0, 0), SPEC)
    damaged = bytearray(good)
    damaged[40] ^= 1
    other = Spec({"x": Field((), np.int32)})
    r.xadd(STREAM, {"d": b"garbage"})
    r.xadd(STREAM, {"d": b"garbage, long enough for a prefix of 56 bytes, the format-3 one"})
    r.xadd(STREAM, {"x": b"1"})
    r.xadd(STREAM, {"d": bytes(damaged)})
    r.xadd(STREAM, {"d": encode(make_chunk(0, 9, spec=other), other)})
    r.xadd(STREAM, {"d": encode(make_chunk(0, 8, s=8, t=32), SPEC)})
    r.xadd(STREAM, {"d": good})
    got = receive_all(reader, 1, timeout_s=5)
    assert [c.identity for c in got] == [(0, 0)]
    assert reader.stats.rejected == {"truncated": 1, "format": 1, "malformed_entry": 1, "checksum": 1,
                                     "spec": 1, "too_large": 1}
    reader.flush()
    assert r.xpending(STREAM, "learners")["pending"] == 0


def test_an_entry_refused_is_counted_once_when_a_re_read_returns_it_again(redis_server) -> None:
    """A failed call makes the reader re-read its pending list from the start, and that read
    carries no XACK: an entry refused just before (its XACK still queued) comes back. Seen in
    the train fault test after a redis-server restart: one garbage entry counted twice."""
    transport = make(redis_server)
    reader = transport.reader()
    r = client(redis_server)
    r.xadd(STREAM, {"d": b"garbage"})
    r.xadd(STREAM, {"x": b"1"})
    while not reader.stats.rejected:  # one read at a time: the XACKs go with the next
        assert reader.receive(10, timeout_s=0) == []
    assert reader.stats.rejected == {"truncated": 1, "malformed_entry": 1}
    assert r.xpending(STREAM, "learners")["pending"] == 2  # their XACKs wait for the next read
    reader._pending_cursor = b"0"  # what a failed XREADGROUP > or XAUTOCLAIM leaves
    assert reader.receive(10, timeout_s=0.2) == []
    assert reader.stats.rejected == {"truncated": 1, "malformed_entry": 1}
    reader.flush()
    assert r.xpending(STREAM, "learners")["pending"] == 0


def test_trimming_never_drops_unacknowledged_entries(redis_server) -> None:
    transport = make(redis_server)
    writer, reader = transport.writer(), transport.reader()
    r = client(redis_server)
    for q in range(10):
        writer.send(make_chunk(0, q))
    got = reader.receive(5, timeout_s=1)
    assert trim_acknowledged(r, STREAM, exact=True) == 10  # delivered but not acknowledged
    reader.ack(got[:3])
    assert trim_acknowledged(r, STREAM, exact=True) == 10  # queued, not yet sent
    reader.flush()
    assert trim_acknowledged(r, STREAM, exact=True) == 7
    r.xgroup_create(STREAM, "archiver", id="0")  # a second group that has read nothing
    reader.ack(got[3:])
    reader.flush()
    assert trim_acknowledged(r, STREAM, exact=True) == 7


def test_back_pressure_blocks_the_writer_and_bounds_the_stream(redis_server) -> None:
    transport = make(redis_server, max_len=4)
    writer = transport.writer()
    for q in range(4):
        writer.send(make_chunk(0, q), timeout_s=1)
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout, match="not draining"):
        writer.send(make_chunk(0, 4), timeout_s=0.3)
    assert time.monotonic() - t0 >= 0.29
    reader = transport.reader()
    r = client(redis_server)
    lengths: list[int] = []
    got: list = []

    def drain() -> None:
        while len(got) < 204:
            chunks = reader.receive(2, timeout_s=0.1)
            lengths.append(r.xlen(STREAM))
            time.sleep(0.002)  # a slow learner
            reader.ack(chunks)
            got.extend(chunks)

    thread = threading.Thread(target=drain)
    thread.start()
    for q in range(4, 204):
        writer.send(make_chunk(0, q), timeout_s=10)
        lengths.append(r.xlen(STREAM))
    thread.join(timeout=30)
    assert [c.sequence for c in got] == list(range(204))  # nothing dropped, in order
    assert max(lengths) <= 4  # the capped add never overshoots


def test_writer_times_out_while_the_server_is_down(redis_factory) -> None:
    server = redis_factory()
    writer = make(server).writer()
    writer.send(make_chunk(0, 0))
    server.stop()
    t0 = time.monotonic()
    # A send is one write of XADD + XLEN: the first write after the server went away
    # can still land in the socket's buffer (the reset comes back after it), so the
    # failure shows at that send or the next; the chunks stay queued for re-sending.
    with pytest.raises(TransportTimeout, match="unreachable"):
        for q in (1, 2):
            writer.send(make_chunk(0, q), timeout_s=0.3)
    assert time.monotonic() - t0 < 3


@pytest.mark.slow
@pytest.mark.parametrize("appendonly", [True, False])
def test_server_restart_under_running_writer_and_reader(redis_factory, appendonly: bool) -> None:
    server = redis_factory(appendonly=appendonly)
    transport = make(server, max_len=50, reconnect_timeout_s=30)
    reader = transport.reader()
    proc = mp.get_context("spawn").Process(target=send_chunks, args=(transport, 1, 400, 30.0))
    proc.start()
    got: list = []
    try:
        while len(got) < 60:
            chunks = reader.receive(16, timeout_s=0.2)
            reader.ack(chunks)
            got.extend(chunks)
        assert max(c.sequence for c in got) < 300  # the writer is still sending
        server.restart(down_s=0.5)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(c.sequence == 399 for c in got):
            chunks = reader.receive(16, timeout_s=0.2)
            reader.ack(chunks)
            got.extend(chunks)
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
    assert proc.exitcode == 0
    seqs = [c.sequence for c in got]
    assert len(seqs) == len(set(seqs)), "a duplicate got through"
    if appendonly:  # nothing written is lost when the server keeps its data
        assert sorted(seqs) == list(range(400))
    else:  # unread entries die with the server; everything after the restart arrives
        assert 399 in seqs and seqs == sorted(seqs)


def test_trim_threshold_compares_ids_as_numbers(redis_server) -> None:
    r = client(redis_server)
    for entry_id in ("1-1", "1-2", "1-10", "2-0", "10-0"):
        r.xadd("ids", {"d": b"x"}, id=entry_id)
    r.xgroup_create("ids", "g", id="0")
    r.xreadgroup("g", "c", {"ids": ">"}, count=3)  # 1-1, 1-2, 1-10 delivered
    r.xack("ids", "g", "1-1", "1-2")  # 1-10 still pending ("10" > "2" as numbers only)
    assert trim_acknowledged(r, "ids", exact=True) == 3
    assert [e[0] for e in r.xrange("ids")] == [b"1-10", b"2-0", b"10-0"]
    r.xack("ids", "g", "1-10")
    r.xreadgroup("g", "c", {"ids": ">"})
    r.xack("ids", "g", "2-0", "10-0")
    assert trim_acknowledged(r, "ids", exact=True) == 1  # the last delivered entry stays
    assert trim_acknowledged(r, "nothing-here", exact=False) == 0


def test_writer_packets_are_what_redis_py_sends_and_land_as_entries(redis_server) -> None:
    # The writer packs XADD + XLEN itself (the chunk encoded in place): byte for byte
    # what redis-py would send for the two commands, for any stream name.
    from shardreplay.transport.codec import Encoding
    from shardreplay.transport.redis import XaddPacker

    conn = redis.Connection()
    for stream in ("shardreplay:chunks", "s", "流-ü 1"):
        enc = Encoding(make_chunk(0, 3, priorities=True), SPEC)
        packet = XaddPacker(stream, b"d").packet(enc)
        data = encode(make_chunk(0, 3, priorities=True), SPEC)
        commands = [conn.pack_command("XADD", stream, "*", b"d", data), conn.pack_command("XLEN", stream)]
        want = b"".join(bytes(part) for command in commands for part in command)
        assert bytes(packet) == want, stream
    transport = make(redis_server, stream="流-ü 1")
    writer, reader = transport.writer(), transport.reader()
    for q in range(20):
        writer.send(make_chunk(2, q), timeout_s=5)
    got = receive_all(reader, 20, timeout_s=5)
    assert [c.sequence for c in got] == list(range(20))
    assert client(redis_server).xlen("流-ü 1") == 20
    writer.close()


def _looks(r: redis.Redis) -> int:
    """Trim-and-length looks the server ran so far (the trim script, ``EVALSHA``)."""
    return int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_a_writer_at_the_cap_waits_for_a_room_token_instead_of_polling(redis_server) -> None:
    # Writers at max_len used to trim-and-look every 0.5-5 ms (at 32 writers that cost
    # more CPU than their sends); now they wait in BLPOP for the token the reader pushes
    # with each XACK, looking only when one comes (or every 100 ms without one).
    transport = make(redis_server, max_len=2)
    writer, reader, r = transport.writer(), transport.reader(), client(redis_server)
    for q in range(2):
        writer.send(make_chunk(0, q), timeout_s=1)
    held = receive_all(reader, 2, timeout_s=5, ack=False)  # delivered, unacknowledged: the stream is full
    done = threading.Event()
    thread = threading.Thread(target=lambda: (writer.send(make_chunk(0, 2), timeout_s=10), done.set()))
    looks0 = _looks(r)
    thread.start()
    time.sleep(0.5)
    looks = _looks(r) - looks0
    assert not done.is_set()
    assert looks <= 12, f"{looks} looks in 0.5 s: the blocked writer polls"  # polling: ~100
    reader.ack(held)
    reader.flush()  # the XACK and its tokens
    thread.join(timeout=10)
    assert done.is_set()
    assert [c.sequence for c in receive_all(reader, 1, timeout_s=5)] == [2]
    for q in range(3, 12):  # tokens no writer takes stay bounded by max_len
        writer.send(make_chunk(0, q), timeout_s=5)
        reader.ack(receive_all(reader, 1, timeout_s=5))
        reader.flush()
    assert 1 <= r.llen(f"{STREAM}:room") <= 2
    writer.close()
    reader.close()


def test_writers_poll_for_room_when_the_acl_refuses_room_tokens(redis_server, caplog) -> None:
    # An ACL made for an older release (no BLPOP/RPUSH/LTRIM): one warning per end,
    # then back-pressure works as before, by polling.
    client(redis_server).acl_setuser("old", enabled=True, passwords=["+pw"], keys=["*"],
                                     commands=["+@all", "-blpop", "-rpush", "-ltrim"])
    transport = open_transport(redis_server.url.replace("redis://", "redis://old:pw@"), SPEC, max_len=2)
    writer, reader = transport.writer(), transport.reader()
    for q in range(2):
        writer.send(make_chunk(0, q), timeout_s=1)
    held = receive_all(reader, 2, timeout_s=5, ack=False)
    thread = threading.Thread(target=writer.send, args=(make_chunk(0, 2),), kwargs={"timeout_s": 10})
    thread.start()
    time.sleep(0.2)
    reader.ack(held)
    reader.flush()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert [c.sequence for c in receive_all(reader, 1, timeout_s=5)] == [2]
    refusals = [rec for rec in caplog.records if "waiting for room by polling" in rec.getMessage()]
    assert len(refusals) == 2, [rec.getMessage() for rec in refusals]  # writer BLPOP, reader RPUSH
    assert client(redis_server).exists(f"{STREAM}:room") == 0
    writer.close()
    reader.close()


def test_the_reader_takes_half_the_stream_at_a_time(redis_server) -> None:
    # What the reader holds unacknowledged counts against max_len: taking all of it left
    # the writers no room until the next read (8 writers into a 32-entry stream: the
    # learner waited ~8 ms a read for them); half lets them refill while it stores.
    transport = make(redis_server, max_len=4)
    writer, reader = transport.writer(), transport.reader()
    for q in range(4):
        writer.send(make_chunk(0, q), timeout_s=1)
    assert [c.sequence for c in reader.receive(64, timeout_s=1)] == [0, 1]
    assert [c.sequence for c in reader.receive(64, timeout_s=1)] == [2, 3]
    writer.close()
    reader.close()


def test_a_room_token_wait_loads_the_trim_script_again_after_a_flush(redis_server) -> None:
    # The token wait runs the trim by its SHA in the same round trip; a server that lost
    # its scripts (restarted) answers NOSCRIPT, and the look loads it instead of failing.
    from shardreplay.transport.redis import RoomTokens

    r = client(redis_server)
    for _ in range(3):
        r.xadd(STREAM, {"d": b"x"})
    room = RoomTokens(STREAM, 8)
    r.script_flush()
    r.rpush(room.key, b"1")
    assert room.wait_then_trim(r, 1.0) == 3  # no group: nothing trimmed, the length
    assert r.llen(room.key) == 0  # the token was taken
    t0 = time.monotonic()
    assert room.wait_then_trim(r, 0.05) == 3  # no token: back after the timeout
    assert time.monotonic() - t0 >= 0.04
