"""The file spool: atomic publication, quarantine, back-pressure, killed writers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from shardreplay.errors import TransportError, TransportTimeout
from shardreplay.spec import Field, Spec
from shardreplay.transport import open_transport
from shardreplay.transport.codec import encode
from shardreplay.transport.spool import SpoolTransport, chunk_file_name
from tests.transport.transport_helpers import SPEC, assert_same_chunk, make_chunk, receive_all


def spool(path: Path, **options) -> SpoolTransport:
    transport = open_transport(path.absolute().as_uri(), SPEC, **options)
    assert isinstance(transport, SpoolTransport)
    return transport


def test_round_trip_in_order_per_actor(tmp_path: Path) -> None:
    transport = spool(tmp_path)
    writer = transport.writer()
    for seq in (0, 1, 2, 10, 11):
        for actor in (2, 1):
            writer.send(make_chunk(actor, seq, priorities=True))
    reader = transport.reader()
    got = receive_all(reader, 10, timeout_s=5)
    for actor in (1, 2):
        assert [c.sequence for c in got if c.actor_id == actor] == [0, 1, 2, 10, 11]
    for c in got:
        assert_same_chunk(c, make_chunk(c.actor_id, c.sequence, priorities=True))
    assert os.listdir(tmp_path / "ready") == []
    assert reader.stats.acked == 10


def test_unacknowledged_chunks_are_delivered_again_to_the_next_reader(tmp_path: Path) -> None:
    transport = spool(tmp_path)
    writer = transport.writer()
    for seq in range(4):
        writer.send(make_chunk(0, seq))
    reader = transport.reader()
    first = reader.receive(4)
    reader.ack(first[:2])
    assert reader.receive(4, timeout_s=0.05) == []  # in flight: not delivered twice
    reader.close()
    again = transport.reader()
    assert [c.sequence for c in again.receive(10)] == [2, 3]


def test_one_reader_per_spool(tmp_path: Path) -> None:
    transport = spool(tmp_path)
    reader = transport.reader()
    with pytest.raises(TransportError, match="one reader per spool"):
        transport.reader()
    reader.close()
    transport.reader().close()


def test_temp_files_are_never_read(tmp_path: Path) -> None:
    transport = spool(tmp_path, stale_tmp_s=3600)
    transport.writer().send(make_chunk(0, 0))
    data = encode(make_chunk(0, 1), SPEC)
    (tmp_path / "tmp" / (chunk_file_name(0, 1) + ".123.abcd.tmp")).write_bytes(data[: len(data) // 2])
    (tmp_path / "tmp" / (chunk_file_name(0, 2) + ".123.abcd.tmp")).write_bytes(encode(make_chunk(0, 2), SPEC))
    reader = transport.reader()
    assert [c.sequence for c in receive_all(reader, 1, timeout_s=0.3)] == [0]
    assert reader.receive(10, timeout_s=0.1) == []
    assert reader.stats.total_rejected == 0
    assert len(os.listdir(tmp_path / "tmp")) == 2  # young temp files are left to their writers


KILL_WRITER = textwrap.dedent("""
    import os, signal, sys, numpy as np
    from shardreplay._io import atomic_writer
    from shardreplay.spec import Field, Spec
    from shardreplay.transport import Chunk, open_transport, spool
    spec = Spec({"obs": Field((4096,), np.float32)})
    w = open_transport(sys.argv[1], spec, queued_chunks_per_actor=10_000).writer()
    s, t = 8, 64
    rng = np.random.default_rng(0)  # incompressible: the file is large
    steps = {"obs": rng.random((s, t, 4096), np.float32), "step_type": np.ones((s, t), np.uint8)}

    def half_then_killed(path, data, *, fsync=True, tmp_dir=None):
        with atomic_writer(path, fsync=fsync, tmp_dir=tmp_dir) as f:
            f.write(data[: len(data) // 2])
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # a real kill, in the middle of the write

    for seq in range(4):
        if seq == 3:
            spool.atomic_write_bytes = half_then_killed
        w.send(Chunk(7, seq, 0, np.arange(s), steps))
""")


def test_writer_killed_mid_write_leaves_nothing_half_ingested(tmp_path: Path) -> None:
    big = Spec({"obs": Field((4096,), np.float32)})
    url = tmp_path.absolute().as_uri()
    proc = subprocess.run([sys.executable, "-c", KILL_WRITER, url], timeout=120, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    ready = sorted(os.listdir(tmp_path / "ready"))
    assert len(ready) == 3
    full_size = (tmp_path / "ready" / ready[0]).stat().st_size
    temps = list((tmp_path / "tmp").glob("*.tmp"))
    assert len(temps) == 1 and 0 < temps[0].stat().st_size < full_size
    transport = open_transport(url, big, stale_tmp_s=3600)
    reader = transport.reader()
    got = receive_all(reader, len(ready), timeout_s=10)
    assert sorted((c.actor_id, c.sequence) for c in got) == sorted(
        (7, int(n.split("-")[1].split(".")[0])) for n in ready)
    assert reader.receive(10, timeout_s=0.1) == []
    assert reader.stats.total_rejected == 0
    reader.close()
    open_transport(url, big, stale_tmp_s=0).reader().close()  # a new reader sweeps dead writers' temps
    assert list((tmp_path / "tmp").glob("*.tmp")) == []


def test_corrupt_and_truncated_files_are_quarantined_and_counted(tmp_path: Path) -> None:
    transport = spool(tmp_path)
    writer = transport.writer()
    for seq in range(5):
        writer.send(make_chunk(1, seq))
    ready = tmp_path / "ready"
    damaged = bytearray((ready / chunk_file_name(1, 2)).read_bytes())
    damaged[len(damaged) // 2] ^= 0x10
    (ready / chunk_file_name(1, 2)).write_bytes(damaged)
    short = (ready / chunk_file_name(1, 3)).read_bytes()
    (ready / chunk_file_name(1, 3)).write_bytes(short[:100])
    (ready / "notes.txt").write_text("not a chunk")
    other = Spec({"x": Field((), np.int32)})
    (ready / chunk_file_name(9, 0)).write_bytes(encode(make_chunk(9, 0, spec=other), other))
    reader = transport.reader()
    got = receive_all(reader, 3, timeout_s=5)
    assert [c.sequence for c in got] == [0, 1, 4]
    assert reader.stats.rejected == {"checksum": 1, "truncated": 1, "name": 1, "spec": 1}
    quarantined = sorted(os.listdir(tmp_path / "quarantine"))
    assert chunk_file_name(1, 2) in quarantined and chunk_file_name(1, 3) in quarantined
    assert (tmp_path / "quarantine" / (chunk_file_name(1, 2) + ".reason")).read_text() == "checksum\n"
    assert os.listdir(ready) == []
    writer.send(make_chunk(1, 5))  # the reader lives on
    assert [c.sequence for c in receive_all(reader, 1, timeout_s=5)] == [5]
    # Queued for the consumer's loss records, with the identity the header claims if readable.
    assert sorted(reader.stats.dropped) == sorted([
        (1, 2, 1, "rejected by the transport: checksum"), (-1, -1, 1, "rejected by the transport: truncated"),
        (-1, -1, 1, "rejected by the transport: name"), (9, 0, 1, "rejected by the transport: spec")])


@pytest.mark.parametrize("name", [".{final}.Xy12Ab", "{final}.123.abcd.tmp"])
def test_a_temp_file_in_ready_is_left_to_its_writer_until_it_goes_stale(tmp_path: Path, name: str) -> None:
    """A tool that copies chunks into ready/ under a temp name (rsync: ``.name.XXXXXX``)
    and renames them when done is not cut short; one that died leaves a file that is
    quarantined once it has been unchanged for ``stale_tmp_s``."""
    transport = spool(tmp_path, stale_tmp_s=3600)
    data = encode(make_chunk(0, 0), SPEC)
    growing = tmp_path / "ready" / name.format(final=chunk_file_name(0, 0))
    reader = transport.reader()
    growing.write_bytes(data[:100])
    assert reader.receive(10, timeout_s=0.05) == []
    assert reader.stats.total_rejected == 0 and growing.exists()
    with growing.open("ab") as f:
        f.write(data[100:])
    growing.rename(tmp_path / "ready" / chunk_file_name(0, 0))
    assert [c.sequence for c in receive_all(reader, 1, timeout_s=5)] == [0]
    reader.close()

    stale = tmp_path / "ready" / name.format(final=chunk_file_name(0, 1))
    stale.write_bytes(data[:100])
    os.utime(stale, (time.time() - 60, time.time() - 60))
    reader = spool(tmp_path, stale_tmp_s=30).reader()
    assert reader.receive(10, timeout_s=0.05) == []
    assert reader.stats.rejected == {"stale_temp": 1}
    assert (tmp_path / "quarantine" / (stale.name + ".reason")).read_text() == "stale_temp\n"


def test_oversized_files_are_quarantined_unread(tmp_path: Path) -> None:
    transport = spool(tmp_path, max_chunk_bytes=200)
    transport.writer().send(make_chunk(0, 0, s=4, t=8))
    reader = transport.reader()
    assert reader.receive(10, timeout_s=0.1) == []
    assert reader.stats.rejected == {"too_large": 1}


def test_back_pressure_per_actor(tmp_path: Path) -> None:
    transport = spool(tmp_path, queued_chunks_per_actor=2)
    writer = transport.writer()
    writer.send(make_chunk(0, 0))
    writer.send(make_chunk(0, 1))
    writer.send(make_chunk(1, 0), timeout_s=0.1)  # another actor has its own budget
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout, match="still unread"):
        writer.send(make_chunk(0, 2), timeout_s=0.2)
    assert time.monotonic() - t0 >= 0.19
    restarted = transport.writer()  # a new writer counts what is already there
    with pytest.raises(TransportTimeout):
        restarted.send(make_chunk(0, 2), timeout_s=0.05)
    reader = transport.reader()
    reader.ack(reader.receive(1))
    writer.send(make_chunk(0, 2), timeout_s=1)
    assert len(os.listdir(tmp_path / "ready")) == 3


def test_a_writer_waiting_for_room_backs_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Hundreds of writers blocked on a spool nobody reads must not keep the host busy: each
    # one's pauses grow to 50 ms instead of staying at the 5 ms poll interval (200 looks a
    # second). Counted, not timed: a loaded machine only makes the count smaller.
    import shardreplay.transport.spool as spool_module

    transport = spool(tmp_path, queued_chunks_per_actor=1)
    writer = transport.writer()
    writer.send(make_chunk(0, 0))
    pauses: list[float] = []
    real_sleep = time.sleep

    def counted_sleep(seconds: float) -> None:
        pauses.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(spool_module.time, "sleep", counted_sleep)
    with pytest.raises(TransportTimeout):
        writer.send(make_chunk(0, 1), timeout_s=1.0)
    assert len(pauses) <= 30, len(pauses)
    assert max(pauses) == pytest.approx(0.05)
