"""Each transport names its shards' channels and reports what waits in them (``channel``,
``channels``, ``backlog``), counted against chunks really sent and consumed."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardreplay.errors import ConfigError
from shardreplay.transport import open_transport
from shardreplay.transport.base import Backlog
from shardreplay.transport.codec import encode
from tests.transport.transport_helpers import SPEC, make_chunk


def _sizes(count: int, actor_id: int = 1) -> int:
    return sum(len(encode(make_chunk(actor_id, q), SPEC)) for q in range(count))


def test_local_backlog_counts_the_ring_records_and_their_bytes() -> None:
    transport = open_transport("local", SPEC, capacity_bytes=1 << 20)
    assert transport.channel(2, "run-a") == "local:shard-2" and transport.channels(2) == []
    writer, reader = transport.writer(), transport.reader()
    assert transport.backlog() == Backlog(0, 0)
    for q in range(5):
        writer.send(make_chunk(1, q))
    assert transport.backlog() == Backlog(5, _sizes(5))
    got = reader.receive(2)
    assert transport.backlog() == Backlog(3, _sizes(5) - _sizes(2))
    got = reader.receive(10, borrow=True)  # lent in place: still in the ring until given back
    assert len(got) == 3 and transport.backlog().chunks == 3
    assert reader.receive(10, timeout_s=0.01) == [] and transport.backlog() == Backlog(0, 0)
    with pytest.raises(ConfigError, match="its own ring"):
        transport.backlog("local:shard-0")


def test_spool_names_run_directories_and_counts_ready_files(tmp_path: Path) -> None:
    base = open_transport(tmp_path.as_uri(), SPEC)
    assert base.channel(1) == str(tmp_path / "shard-1")
    assert base.channel(1, "run-a") == str(tmp_path / "run-a" / "shard-1")
    assert base.channels(1) == [] and base.backlog(base.channel(1)) == Backlog(0, 0)  # nothing created
    assert not (tmp_path / "shard-1").exists()
    shard = open_transport(f"file://{base.channel(1, 'run-a')}", SPEC)
    writer = shard.writer()
    for q in range(4):
        writer.send(make_chunk(1, q))
    (tmp_path / "run-a" / "shard-1" / "ready" / "x.chunk.123.ab.tmp").write_bytes(b"half")  # a writer's temp
    assert base.channels(1) == [str(tmp_path / "run-a" / "shard-1")]
    assert shard.backlog() == base.backlog(base.channel(1, "run-a")) == Backlog(4, _sizes(4))
    reader = shard.reader()
    got = reader.receive(3, timeout_s=5.0)
    reader.ack(got)
    assert shard.backlog() == Backlog(1, _sizes(4) - _sizes(3))
    reader.close()


@pytest.mark.redis
def test_redis_names_run_streams_and_counts_what_no_group_acknowledged(redis_server) -> None:
    base = open_transport(redis_server.url, SPEC)
    assert base.channel(0) == "shardreplay:chunks:0"
    assert base.channel(0, "run-a") == "shardreplay:run-a:chunks:0"
    assert base.channels(0) == []
    shard = open_transport(redis_server.url, SPEC, stream=base.channel(0, "run-a"))
    writer = shard.writer()
    for q in range(5):
        writer.send(make_chunk(1, q))
    writer.close()
    assert shard.backlog() == Backlog(5, None)  # no group yet: the stream's length
    reader = shard.reader()
    got = reader.receive(3, timeout_s=5.0)
    assert len(got) == 3
    reader.ack(got[:2])  # one delivered and pending, two never delivered
    reader.close()
    assert base.backlog("shardreplay:run-a:chunks:0") == Backlog(3, None)
    assert base.channels(0) == ["shardreplay:run-a:chunks:0"]
    assert base.backlog("shardreplay:none:chunks:0") == Backlog(0, None)
