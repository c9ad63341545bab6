"""The local transport: a bounded shared-memory ring between spawned processes."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

from shardreplay.errors import ConfigError, SpecMismatchError, TransportTimeout
from shardreplay.transport import open_transport
from shardreplay.transport.codec import Chunk, encode
from shardreplay.transport.local import LocalTransport
from tests.transport.transport_helpers import (
    SPEC,
    assert_same_chunk,
    fill_ring_forever,
    hold_ring_lock_forever,
    join_or_kill,
    make_chunk,
    receive_all,
    send_chunks,
)


def test_round_trip_in_one_process() -> None:
    transport = open_transport("local", SPEC)
    writer, reader = transport.writer(), transport.reader()
    chunks = [make_chunk(1, q, priorities=q % 2 == 0) for q in range(5)]
    for c in chunks:
        writer.send(c)
    got = reader.receive(3)
    got += reader.receive(10)
    assert len(got) == 5
    for a, b in zip(chunks, got, strict=True):
        assert_same_chunk(a, b)
    assert reader.receive(10, timeout_s=0.05) == []
    assert reader.stats.received == 5


@pytest.mark.slow
def test_two_spawned_actors_into_one_reader_in_order_per_actor() -> None:
    transport = LocalTransport(SPEC, capacity_bytes=16 * len(encode(make_chunk(), SPEC)))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=send_chunks, args=(transport, a, 200)) for a in (3, 4)]
    for p in procs:
        p.start()
    try:
        reader = transport.reader()
        got = receive_all(reader, 400)
    finally:
        join_or_kill(procs)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(got) == 400
    for actor in (3, 4):
        seqs = [c.sequence for c in got if c.actor_id == actor]
        assert seqs == list(range(200))
        for c in got[:5]:
            assert_same_chunk(c, make_chunk(c.actor_id, c.sequence))
    assert reader.stats.as_dict() == {"received": 400, "duplicates": 0, "acked": 400, "lost": 0,
                                      "rejected": {}}


def test_back_pressure_blocks_then_times_out_with_bounded_memory() -> None:
    size = len(encode(make_chunk(), SPEC)) + 8
    transport = LocalTransport(SPEC, capacity_bytes=3 * size + 10)
    writer, reader = transport.writer(), transport.reader()
    for q in range(3):
        writer.send(make_chunk(0, q), timeout_s=0.1)
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout, match="draining"):
        writer.send(make_chunk(0, 3), timeout_s=0.2)
    assert time.monotonic() - t0 >= 0.19
    assert len(reader.receive(1)) == 1
    writer.send(make_chunk(0, 3), timeout_s=0.1)  # room again
    assert [c.sequence for c in reader.receive(10)] == [1, 2, 3]


def test_a_chunk_larger_than_the_ring_is_a_config_error() -> None:
    transport = LocalTransport(SPEC, capacity_bytes=1024)
    with pytest.raises(ConfigError, match="capacity_bytes"):
        transport.writer().send(make_chunk(s=8, t=32))


def test_records_wrap_around_the_ring_end() -> None:
    size = len(encode(make_chunk(), SPEC)) + 8
    transport = LocalTransport(SPEC, capacity_bytes=int(2.5 * size))
    writer, reader = transport.writer(), transport.reader()
    for q in range(20):
        writer.send(make_chunk(0, q), timeout_s=1)
        [got] = reader.receive(1)
        assert_same_chunk(got, make_chunk(0, q))


def test_chunks_encoded_in_place_equal_encode_over_old_bytes() -> None:
    # Writers encode straight into the ring's memory: every padding byte must be written
    # too, whatever an earlier record left there (here 0xFF), wrapped or not.
    size = len(encode(make_chunk(), SPEC)) + 8
    transport = LocalTransport(SPEC, capacity_bytes=int(2.5 * size))
    ring, writer = transport._ring, transport.writer()
    for q in range(6):
        assert ring.put(b"\xff" * (size - 8), None)
        ring.take(1, time.monotonic())
        writer.send(make_chunk(0, q), timeout_s=1)
        [raw] = ring.take(1, time.monotonic())
        assert bytes(raw) == encode(make_chunk(0, q), SPEC)


def test_garbage_and_duplicates_are_counted_and_skipped() -> None:
    transport = LocalTransport(SPEC)
    writer, reader = transport.writer(), transport.reader()
    transport._ring.put(b"not a chunk at all", None)
    bad = bytearray(encode(make_chunk(0, 0), SPEC))
    bad[-1] ^= 1
    transport._ring.put(bytes(bad), None)
    writer.send(make_chunk(0, 0))
    writer.send(make_chunk(0, 0))
    writer.send(make_chunk(0, 1))
    got = receive_all(reader, 2, timeout_s=2)
    assert [c.sequence for c in got] == [0, 1]
    assert reader.stats.rejected == {"truncated": 1, "checksum": 1}
    assert reader.stats.duplicates == 1


def _spawn_and_kill(target, transport, until) -> None:
    """Start ``target(transport)`` in a child, wait until ``until(pid)`` holds, SIGKILL it."""
    proc = mp.get_context("spawn").Process(target=target, args=(transport,))
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while not until(proc.pid):
            assert proc.is_alive() and time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.1)
    finally:
        proc.kill()
        proc.join(timeout=30)  # reaped: a zombie would also count as dead


def test_an_actor_killed_holding_the_ring_lock_does_not_wedge_the_others() -> None:
    transport = LocalTransport(SPEC)
    writer, reader = transport.writer(), transport.reader()
    writer.send(make_chunk(0, 0))
    _spawn_and_kill(hold_ring_lock_forever, transport, lambda pid: transport._ring._meta[2] == pid)
    t0 = time.monotonic()
    writer.send(make_chunk(0, 1), timeout_s=10)
    got = receive_all(reader, 2, timeout_s=10)
    assert [c.sequence for c in got] == [0, 1]
    assert time.monotonic() - t0 < 5


def test_an_actor_killed_while_waiting_for_room_does_not_wedge_the_others() -> None:
    size = len(encode(make_chunk(), SPEC)) + 8
    transport = LocalTransport(SPEC, capacity_bytes=4 * size)
    ring = transport._ring
    _spawn_and_kill(fill_ring_forever, transport,  # killed while it waits for room
                    lambda pid: ring._meta[0] - ring._meta[1] == 4 * size)
    reader = transport.reader()
    got = receive_all(reader, 4, timeout_s=10)
    assert [c.sequence for c in got] == [0, 1, 2, 3]
    writer = transport.writer()
    for q in range(10):
        writer.send(make_chunk(1, q), timeout_s=5)
        assert [c.sequence for c in reader.receive(1, timeout_s=5)] == [q]


def test_ring_batches_come_back_whole_in_order_and_aligned() -> None:
    from shardreplay.transport.local import ShmRing

    ring = ShmRing(4096, mp.get_context("spawn"))
    records = [bytes([i]) * (8 * (i % 5 + 1)) for i in range(12)]  # 8-byte multiples, as chunks are
    for r in records[:10]:
        assert ring.put(r, time.monotonic() + 1)
    first = ring.take(4, time.monotonic() + 1)
    for r in records[10:]:
        assert ring.put(r, time.monotonic() + 1)
    rest = ring.take(64, time.monotonic() + 1)
    assert [bytes(v) for v in first + rest] == records
    assert all(v.readonly for v in first + rest)
    assert all(np.frombuffer(v, np.uint8).ctypes.data % 8 == 0 for v in first + rest)
    assert ring.take(1, time.monotonic()) == []


def test_ring_batches_stop_at_max_bytes_but_never_come_back_empty() -> None:
    from shardreplay.transport.local import ShmRing

    ring = ShmRing(4096, mp.get_context("spawn"))
    for i in range(6):
        assert ring.put(bytes([i]) * 96, None)  # 104 bytes a record with its length
    assert [bytes(v)[0] for v in ring.take(64, time.monotonic(), max_bytes=250)] == [0, 1, 2]  # 208 < 250
    assert [bytes(v)[0] for v in ring.take(64, time.monotonic(), max_bytes=10)] == [3]  # one at least
    assert [bytes(v)[0] for v in ring.take(64, time.monotonic())] == [4, 5]


def test_ring_lengths_split_by_the_ring_end_are_read_whole() -> None:
    # Odd record sizes and an odd capacity put a record's 8-byte length across the
    # ring's end at many offsets (the take reads a length in place only when it does
    # not wrap).
    from shardreplay.transport.local import ShmRing

    ring = ShmRing(1001, mp.get_context("spawn"))
    rng = np.random.default_rng(5)
    split = 0
    for i in range(400):
        data = rng.integers(0, 256, int(rng.integers(1, 300)), dtype=np.uint8).tobytes()
        at = ring._meta[0] % ring.capacity
        split += at + 8 > ring.capacity
        assert ring.put(data, time.monotonic() + 1)
        assert [bytes(v) for v in ring.take(4, time.monotonic() + 1)] == [data], i
    assert split >= 3  # the case under test happened


def test_borrowed_records_keep_their_room_until_given_back() -> None:
    from shardreplay.transport.local import ShmRing

    ring = ShmRing(1000, mp.get_context("spawn"))
    records = [bytes([i]) * 192 for i in range(8)]  # 200 bytes a record: 5 fill the ring
    for r in records[:5]:
        assert ring.put(r, None)
    lent = ring.take(2, time.monotonic(), borrow=True)
    assert [bytes(v) for v in lent] == records[:2] and all(v.readonly for v in lent)
    assert not ring.put(records[5], time.monotonic() + 0.05)  # lent room is not reused
    ring.give_back()
    ring.give_back()  # nothing lent: nothing happens
    assert ring.put(records[5], None) and ring.put(records[6], None)  # the second wraps
    lent = ring.take(2, time.monotonic(), borrow=True)
    assert [bytes(v) for v in lent] == records[2:4]
    # The next take gives the last loan back first; records crossing the end are copied.
    assert [bytes(v) for v in ring.take(8, time.monotonic(), borrow=True)] == [records[4], *records[5:7]]
    ring.give_back()
    assert ring._meta[0] == ring._meta[1]  # head == tail: everything read and given back


def test_borrowed_chunks_equal_copied_ones_and_close_gives_their_room_back() -> None:
    size = len(encode(make_chunk(), SPEC)) + 8
    transport = LocalTransport(SPEC, capacity_bytes=int(3.5 * size))
    writer, reader = transport.writer(), transport.reader()
    for q in range(12):  # the ring wraps: some borrowed chunks are copies, most are not
        writer.send(make_chunk(2, q, priorities=q % 3 == 0), timeout_s=1)
        [got] = reader.receive(4, timeout_s=1, borrow=True)
        assert_same_chunk(got, make_chunk(2, q, priorities=q % 3 == 0))
        assert not got.steps["obs"].flags.writeable
    for q in range(12, 14):  # beside the last loan, q = 11
        writer.send(make_chunk(2, q), timeout_s=1)
    assert [c.sequence for c in reader.receive(2, timeout_s=1, borrow=True)] == [12, 13]
    writer.send(make_chunk(2, 14), timeout_s=1)  # the loan of 11 was given back
    with pytest.raises(TransportTimeout):  # 12 and 13 lent, 14 waiting: no room for 15
        writer.send(make_chunk(2, 15), timeout_s=0.05)
    reader.close()  # gives the two borrowed chunks' room back
    for q in range(15, 17):
        writer.send(make_chunk(2, q), timeout_s=0.1)
    assert [c.sequence for c in transport.reader().receive(8, timeout_s=1)] == [14, 15, 16]


def test_a_chunk_rejected_while_encoded_in_place_leaves_nothing_in_the_ring() -> None:
    # Exact-dtype steps have their values checked in the ring's memory, after the copy:
    # a bad value raises before the record is published, so the ring stays as it was.
    transport = LocalTransport(SPEC, capacity_bytes=1 << 16)
    writer, reader = transport.writer(), transport.reader()
    good = make_chunk(0, 0)
    steps = {k: np.array(v, SPEC[k].dtype if k in SPEC.names else v.dtype) for k, v in good.steps.items()}
    assert steps["obs"].dtype == np.float32 and steps["step_type"].dtype == np.uint8
    steps["obs"][1, 2, 3] = np.nan
    head = transport._ring._meta[0]
    with pytest.raises(SpecMismatchError, match="obs"):
        writer.send(Chunk(0, 1, 0, good.stream_ids, steps), timeout_s=1)
    assert transport._ring._meta[0] == head  # nothing published
    writer.send(good, timeout_s=1)  # the ring still works
    [got] = reader.receive(8, timeout_s=1)
    assert_same_chunk(got, good)
    assert reader.receive(8, timeout_s=0.05) == [] and reader.stats.total_rejected == 0


@pytest.mark.slow
@pytest.mark.parametrize(("ordered_stores", "borrow"), [(True, False), (False, False), (True, True)])
def test_ring_reader_with_and_without_the_lock_gets_every_record_whole(
        monkeypatch: pytest.MonkeyPatch, ordered_stores: bool, borrow: bool) -> None:
    # Three writer processes into a small ring (it wraps and fills all the time), read
    # with the lock-free path (x86-64) and with the locked one, copied out or borrowed
    # in place: every record arrives once, whole, in order per writer. Borrowed records
    # are checked again after a pause in which the writers wait for room: they must
    # not have been overwritten while lent.
    from shardreplay.transport import local as ring_module
    from tests.transport.transport_helpers import put_ring_records, ring_record

    if ordered_stores and not ring_module._ORDERED_STORES:
        pytest.skip("the lock-free read path runs on x86-64 only")
    monkeypatch.setattr(ring_module, "_ORDERED_STORES", ordered_stores)
    ring = ring_module.ShmRing(16 << 10, mp.get_context("spawn"))
    ctx, count = mp.get_context("spawn"), 600
    procs = [ctx.Process(target=put_ring_records, args=(ring, w, count)) for w in range(3)]
    for p in procs:
        p.start()
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    try:
        deadline = time.monotonic() + 60
        while sum(map(len, got.values())) < 3 * count and time.monotonic() < deadline:
            views = ring.take(int(np.random.default_rng().integers(1, 9)), time.monotonic() + 0.5,
                              borrow=borrow)
            if borrow:
                time.sleep(0.002)
            for view in views:
                data = bytes(view)
                w, q = int.from_bytes(data[:2], "little"), int.from_bytes(data[2:6], "little")
                assert data == ring_record(w, q)
                got[w].append(q)
    finally:
        join_or_kill(procs)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert got == {w: list(range(count)) for w in range(3)}
    assert ring.take(1, time.monotonic()) == []


def test_a_reader_waiting_on_an_empty_ring_is_woken_by_the_next_record() -> None:
    # The reader sleeps on the ring's semaphore (at most 0.1 s at a time); each record
    # put after it found the ring empty must wake it at once, not at the next timeout.
    import threading

    from shardreplay.transport.local import ShmRing

    ring = ShmRing(1 << 16, mp.get_context("spawn"))
    waits = []
    for i in range(40):
        timer = threading.Timer(0.01, ring.put, args=(bytes([i]) * 8, None))
        t0 = time.monotonic()
        timer.start()
        [view] = ring.take(1, time.monotonic() + 2)
        waits.append(time.monotonic() - t0)
        timer.join()
        assert bytes(view) == bytes([i]) * 8
    # A lost wake-up makes every wait about 0.1 s (the put comes 0.01 s into the reader's
    # 0.1 s sleep); the median, not the tail, so a loaded machine's late timer threads
    # cannot fail it.
    assert sorted(waits)[len(waits) // 2] < 0.08, waits
