"""Routing: which learner shard each actor feeds, and that each shard has its own channel.

An actor's streams all go to shard ``actor_id % num_shards``, recomputed from the shard
count in effect (a run resumed from 3 learners on 2 sends actor 2 to shard 0). Each
shard's channel is its own on every medium: ``file://`` a ``shard-<k>`` directory,
``redis://`` a stream per shard, ``local`` a ring per shard.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from shardreplay.runtime.actor.loop import ActorSettings
from shardreplay.runtime.routing import chunk_bytes, shard_transport
from shardreplay.runtime.settings import TrainSettings
from shardreplay.runtime.stream_layout import StreamLayout
from shardreplay.transport.codec import encode
from shardreplay.transport.local import LocalTransport
from shardreplay.transport.redis import RedisTransport
from shardreplay.transport.spool import SpoolTransport
from shardreplay.transport.urls import parse_medium
from tests.runtime.runtime_helpers import CARTPOLE_SPEC, make_chunk


@pytest.mark.parametrize("url, scheme", [("local", "local"), ("", "local"), ("local://", "local"),
                                         ("file:///x/y", "file"), ("redis://127.0.0.1:1/0", "redis"),
                                         ("rediss://127.0.0.1:1/0", "redis"),
                                         ("unix:///tmp/redis.sock", "redis")])
def test_kind_of_every_url_open_transport_takes(url: str, scheme: str) -> None:
    assert parse_medium(url).kind == scheme


def test_file_shards_are_separate_directories(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/spool/"  # a trailing slash changes nothing
    transports = [shard_transport(url, CARTPOLE_SPEC, k) for k in range(3)]
    assert all(isinstance(t, SpoolTransport) for t in transports)
    assert [t.path for t in transports] == [tmp_path / "spool" / f"shard-{k}" for k in range(3)]
    readers = [t.reader() for t in transports]  # one reader lock each: they do not collide
    try:
        for k, t in enumerate(transports):
            t.writer().send(make_chunk(10 + k, 0, spec=CARTPOLE_SPEC))
        for k, r in enumerate(readers):
            got = r.receive(8, timeout_s=2.0)
            assert [c.actor_id for c in got] == [10 + k]
    finally:
        for r in readers:
            r.close()


def test_file_queue_bound_is_per_actor(tmp_path: Path) -> None:
    t = shard_transport(f"file://{tmp_path}", CARTPOLE_SPEC, 1, queued_chunks_per_actor=3, actors=4)
    assert isinstance(t, SpoolTransport) and t.queued_chunks_per_actor == 3


@pytest.mark.redis
def test_redis_shards_are_separate_streams(redis_server) -> None:
    transports = [shard_transport(redis_server.url, CARTPOLE_SPEC, k, queued_chunks_per_actor=2, actors=3)
                  for k in range(2)]
    assert all(isinstance(t, RedisTransport) for t in transports)
    assert [t.stream for t in transports] == ["shardreplay:chunks:0", "shardreplay:chunks:1"]
    assert [t.max_len for t in transports] == [6, 6]  # queued_chunks_per_actor x actors of the shard
    readers = [t.reader() for t in transports]
    writers = [t.writer() for t in transports]
    try:
        for k, w in enumerate(writers):
            w.send(make_chunk(20 + k, 0, spec=CARTPOLE_SPEC), timeout_s=5)
        for k, r in enumerate(readers):
            got = r.receive(8, timeout_s=2.0)
            assert [c.actor_id for c in got] == [20 + k]
            assert r.receive(8, timeout_s=0.1) == []
    finally:
        for end in [*readers, *writers]:
            end.close()


def test_local_shards_are_separate_rings() -> None:
    size = chunk_bytes(CARTPOLE_SPEC, 2, 4)
    assert size >= len(encode(make_chunk(0, 0, spec=CARTPOLE_SPEC), CARTPOLE_SPEC))
    transports = [shard_transport("local", CARTPOLE_SPEC, k, queued_chunks_per_actor=2, actors=2,
                                  chunk_size_bytes=size) for k in range(2)]
    assert all(isinstance(t, LocalTransport) for t in transports)
    assert transports[0]._ring is not transports[1]._ring
    for k, t in enumerate(transports):
        t.writer().send(make_chunk(30 + k, 0, spec=CARTPOLE_SPEC))
    for k, t in enumerate(transports):
        assert [c.actor_id for c in t.reader().receive(8, timeout_s=1.0)] == [30 + k]


@pytest.mark.parametrize("num_actors, num_shards", [(5, 3), (5, 2), (1, 1)])
def test_actor_and_learner_open_the_same_channel(tmp_path: Path, num_actors: int, num_shards: int) -> None:
    """The actor derives its channel from (actor id, shard count) exactly as its learner does."""
    url = f"file://{tmp_path}"
    learner = TrainSettings.from_dict(dict(learners=num_shards, actors=num_actors, transport=url))
    for a, rank in itertools.product(range(num_actors), range(num_shards)):
        actor = ActorSettings(actor_id=a, num_actors=num_actors, num_shards=num_shards, transport=url,
                              policy_url=url)
        shard = StreamLayout(num_actors, 4, num_shards).home_shard(actor.actor_id)
        mine = shard_transport(url, CARTPOLE_SPEC, shard)
        theirs = shard_transport(url, CARTPOLE_SPEC, rank, queued_chunks_per_actor=2,
                                 actors=learner.streams.actors_of_shard(rank))
        assert (mine.path == theirs.path) == (shard == rank)


def test_send_to_the_wrong_shard_never_reaches_another_reader(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    a, b = (shard_transport(url, CARTPOLE_SPEC, k) for k in (0, 1))
    reader_b = b.reader()
    try:
        a.writer().send(make_chunk(0, 0, spec=CARTPOLE_SPEC))
        time.sleep(0.05)
        assert reader_b.receive(8, timeout_s=0.1) == []
    finally:
        reader_b.close()


@pytest.mark.parametrize("transport", ["redis://127.0.0.1:1/0", "rediss://127.0.0.1:1/0"])
def test_policy_goes_through_the_redis_server_of_the_transport(tmp_path: Path, transport: str) -> None:
    redis = TrainSettings.from_dict(dict(transport=transport)).with_run_dir(tmp_path)
    assert redis.transport.policy_url == transport
    spool = TrainSettings.from_dict(dict(transport=f"file://{tmp_path}/spool")).with_run_dir(tmp_path)
    assert spool.transport.policy_url == f"file://{tmp_path.resolve()}/policy"
