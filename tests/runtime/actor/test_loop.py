"""The actor runtime with a real CartPole vector env, a published policy and real media.

``shardreplay.runtime.actor.loop.run`` in this process (chunks, ids, sequences, versions,
policy pick-up), and the ``shardreplay actor`` command in a child process (SIGTERM /
SIGINT stop it with exit 0 after sending what it holds; a Redis restart under it is
survived). Children are always killed and reaped (``runtime_helpers.children``).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from shardreplay.errors import ConfigError
from shardreplay.runtime.actor import loop as actor_module
from shardreplay.runtime.actor.loop import ActorSettings, check_rings_reach, run
from shardreplay.runtime.routing import shard_transport
from shardreplay.runtime.stream_layout import StreamLayout
from shardreplay.spec import StepType
from shardreplay.transport.codec import Chunk, encode
from tests.runtime.runtime_helpers import CARTPOLE_SPEC, children, publish_cartpole_policy, wait_for

START_S = 90.0  # a child imports gymnasium (and torch for some policies): seconds on a loaded machine


pytestmark = pytest.mark.usefixtures("keep_torch_threads")  # conftest.py


def _settings(tmp_path: Path, transport: str, **kw: Any) -> ActorSettings:
    base = dict(actor_id=1, num_actors=3, num_shards=2, envs_per_actor=3, chunk_steps=5,
                transport=transport, policy_url=f"file://{tmp_path}/policy", hidden=(16,), seed=3,
                policy_wait_s=30.0, policy_check_interval_s=0.05)
    base.update(kw)
    return ActorSettings(**base)


def _transport_url(kind: str, tmp_path: Path, redis_factory: Any) -> str:
    if kind == "file":
        return f"file://{tmp_path}/spool"
    return redis_factory().url


def _drain(reader: Any, until: Any, timeout_s: float) -> list[Chunk]:
    """Receive (and acknowledge) chunks until ``until(chunks)`` holds."""
    got: list[Chunk] = []

    def more() -> bool:
        batch = reader.receive(64, timeout_s=0.1)
        reader.ack(batch)
        got.extend(batch)
        return until(got)

    wait_for(more, timeout_s, "chunks from the actor", poll_s=0.0,
             explain=lambda: f" (got {len(got)} chunks)")
    return got


def _steps(chunks: list[Chunk]) -> int:
    return sum(c.num_streams * c.num_steps for c in chunks)


def _check_stream_continuity(chunks: list[Chunk]) -> None:
    """Each stream's steps, chunk after chunk, are a well-formed dm_env sequence."""
    types = np.concatenate([c.steps["step_type"] for c in chunks], axis=1)
    assert (types[:, 0] == StepType.FIRST).all()
    after_last = types[:, 1:][types[:, :-1] == StepType.LAST]
    assert (after_last == StepType.FIRST).all()
    discount = np.concatenate([c.steps["discount"] for c in chunks], axis=1)
    assert (discount[types != StepType.LAST] == 1).all()


@pytest.mark.parametrize("kind", ["file", pytest.param("redis", marks=pytest.mark.redis)])
def test_chunks_have_shape_ids_sequences_and_version(tmp_path: Path, kind: str, redis_factory) -> None:
    url = _transport_url(kind, tmp_path, redis_factory)
    publish_cartpole_policy(f"file://{tmp_path}/policy", 3)
    s = _settings(tmp_path, url, max_env_steps=3 * 23)  # 23 vector steps: 4 chunks of 5, one of 3
    counters = run(s, stop=threading.Event())
    assert counters == {"env_steps": 69, "chunks": 5, "send_retries": 0, "policy_updates": 0}
    shard = StreamLayout(2, 4, 2).home_shard(1)
    transport = shard_transport(url, CARTPOLE_SPEC, shard)
    if kind == "file":
        assert sorted(p.name for p in (tmp_path / "spool").iterdir()) == [f"shard-{shard}"]
    reader = transport.reader()
    try:
        chunks = _drain(reader, lambda got: len(got) >= 5, 20)
        assert reader.receive(64, timeout_s=0.2) == []
    finally:
        reader.close()
    assert [c.num_steps for c in chunks] == [5, 5, 5, 5, 3]  # the last, partial chunk was sent too
    assert _steps(chunks) == counters["env_steps"]
    for c in chunks:
        assert (c.actor_id, c.policy_version, c.num_streams) == (1, 3, 3)
        assert c.stream_ids.tolist() == [0, 1, 2]
        assert c.steps["obs"].shape == (3, c.num_steps, 4) and c.steps["obs"].dtype == np.float32
        assert set(np.unique(c.steps["action"])) <= {0, 1}
    seqs = [c.sequence for c in chunks]
    assert seqs == list(range(seqs[0], seqs[0] + 5))  # consecutive: nothing lost or repeated
    _check_stream_continuity(chunks)


def test_an_actor_with_streams_on_several_shards_sends_each_its_own_chunks(tmp_path: Path) -> None:
    """Fewer actors than shards (2 actors x 3 envs over 4 shards): actor 1's envs 0, 1, 2
    belong to shards 2, 2, 3. Each shard's channel gets chunks of exactly its streams,
    with consecutive sequences of its own, never shared with the other shard's."""
    url = f"file://{tmp_path}/spool"
    publish_cartpole_policy(f"file://{tmp_path}/policy", 3)
    s = _settings(tmp_path, url, num_actors=2, num_shards=4, max_env_steps=3 * 23)
    assert StreamLayout(2, 3, 4).shards(1).tolist() == [2, 2, 3]
    counters = run(s, stop=threading.Event())
    assert counters["env_steps"] == 69 and counters["chunks"] == 10  # 5 per shard
    assert sorted(p.name for p in (tmp_path / "spool").iterdir()) == ["shard-2", "shard-3"]
    got = {}
    for shard, streams in ((2, [0, 1]), (3, [2])):
        reader = shard_transport(url, CARTPOLE_SPEC, shard).reader()
        try:
            chunks = _drain(reader, lambda c: len(c) >= 5, 20)
        finally:
            reader.close()
        assert all(c.stream_ids.tolist() == streams and c.steps["obs"].shape[0] == len(streams)
                   for c in chunks)
        seqs = [c.sequence for c in chunks]
        assert seqs == list(range(seqs[0], seqs[0] + 5))
        _check_stream_continuity(chunks)
        got[shard] = set(seqs)
    assert not got[2] & got[3]


def test_an_actor_handed_the_rings_of_only_some_of_its_shards_is_refused() -> None:
    """Under torchrun with the local transport a rank holds only its own shard's ring."""
    groups = StreamLayout(2, 3, 4).groups(1)  # shards 2 and 3
    check_rings_reach(1, groups, {2: None, 3: None})
    with pytest.raises(ConfigError, match=r"feeds shards \[2, 3\], but the local rings of shards \[3\]"):
        check_rings_reach(1, groups, {2: None})


def test_new_policy_versions_are_picked_up_and_loaded_once(tmp_path: Path, monkeypatch) -> None:
    subscribers: list[Any] = []
    real_open = actor_module.open_subscriber

    def spy(*args: Any, **kwargs: Any) -> Any:
        subscribers.append(real_open(*args, **kwargs))
        return subscribers[-1]

    monkeypatch.setattr(actor_module, "open_subscriber", spy)
    policy = f"file://{tmp_path}/policy"
    publisher = publish_cartpole_policy(policy, 1)
    url = f"file://{tmp_path}/spool"
    s = _settings(tmp_path, url, max_env_steps=3 * 5000, chunk_steps=2)
    stop = threading.Event()
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(run(s, stop=stop)), daemon=True)
    thread.start()
    reader = shard_transport(url, CARTPOLE_SPEC, StreamLayout(2, 4, 2).home_shard(1)).reader()
    try:
        chunks = _drain(reader, lambda got: len(got) >= 3, 60)
        publish_cartpole_policy(policy, 4, publisher=publisher)
        chunks += _drain(reader, lambda got: any(c.policy_version == 4 for c in got), 30)
        publish_cartpole_policy(policy, 9, publisher=publisher)
        chunks += _drain(reader, lambda got: sum(c.policy_version == 9 for c in got) >= 3, 30)
        keep_going = time.monotonic() + 1.0  # ~20 more version checks, no new version
        chunks += _drain(reader, lambda got: time.monotonic() > keep_going, 10)
        stop.set()
        thread.join(30)
        assert not thread.is_alive()
        chunks += _drain(reader, lambda got: _steps(chunks) + _steps(got) >= result["env_steps"], 10)
    finally:
        stop.set()
        thread.join(30)
        reader.close()
    versions = [c.policy_version for c in sorted(chunks, key=lambda c: c.sequence)]
    assert versions[0] == 1 and versions[-1] == 9
    assert versions == sorted(versions) and set(versions) == {1, 4, 9}
    assert result["policy_updates"] == 2
    stats = subscribers[0].stats
    assert stats.loads == 3  # weights read once per version...
    assert stats.checks > 3 * stats.loads  # ...while the cheap version check ran all along
    assert _steps(chunks) == result["env_steps"]


def _actor_cli(tmp_path: Path, transport: str, policy: str, *extra: str) -> list[str]:
    return ["actor", "--actor-id", "0", "--num-actors", "1", "--num-shards", "1", "--transport", transport,
            "--policy-url", policy, "--envs-per-actor", "2", "--chunk-steps", "50", "--seed", "1",
            "--policy-check-interval-s", "0.1", *extra]


def _counters(log: Path) -> dict[str, int]:
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("{")]
    assert lines, log.read_text()[-3000:]
    return json.loads(lines[-1])


@pytest.mark.slow  # fresh interpreters or many examples: 20-100 s at load ~9 on 2 cores
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_the_actor_cleanly_after_sending_what_it_holds(tmp_path: Path, sig: int) -> None:
    policy, url = f"file://{tmp_path}/policy", f"file://{tmp_path}/spool"
    publish_cartpole_policy(policy, 2)
    reader = shard_transport(url, CARTPOLE_SPEC, 0).reader()
    log = tmp_path / "actor.log"
    with children() as kids:
        proc = kids.cli(_actor_cli(tmp_path, url, policy), log)
        try:
            chunks = _drain(reader, lambda got: len(got) >= 2, START_S)
            proc.send_signal(sig)
            assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
            counters = _counters(log)
            chunks += _drain(reader, lambda got: _steps(chunks) + _steps(got) >= counters["env_steps"], 10)
        finally:
            reader.close()
        assert kids.alive() == []
    assert "Traceback" not in log.read_text()
    assert _steps(chunks) == counters["env_steps"] > 0
    assert len(chunks) == counters["chunks"]
    seqs = [c.sequence for c in chunks]
    assert seqs == list(range(seqs[0], seqs[0] + len(chunks)))


@pytest.mark.slow  # fresh interpreters or many examples: 20-100 s at load ~9 on 2 cores
def test_signal_stops_an_actor_still_waiting_for_its_first_policy(tmp_path: Path) -> None:
    log = tmp_path / "actor.log"
    with children() as kids:
        proc = kids.cli(_actor_cli(tmp_path, f"file://{tmp_path}/spool", f"file://{tmp_path}/policy",
                                   "--policy-wait-s", "600"), log)
        wait_for(lambda: "waiting up to" in log.read_text(), START_S, "the actor to wait for a policy",
                 poll_s=0.1, explain=lambda: log.read_text()[-3000:])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, log.read_text()[-3000:]
    assert _counters(log) == {"env_steps": 0, "chunks": 0, "send_retries": 0, "policy_updates": 0}


@pytest.mark.slow
@pytest.mark.redis
def test_actor_survives_a_redis_restart(tmp_path: Path, redis_factory) -> None:
    server = redis_factory(appendonly=True)  # what was written before the restart survives it
    policy = f"file://{tmp_path}/policy"
    publish_cartpole_policy(policy, 1)
    transport = shard_transport(server.url, CARTPOLE_SPEC, 0)
    log = tmp_path / "actor.log"
    with children() as kids:
        proc = kids.cli(_actor_cli(tmp_path, server.url, policy, "--chunk-steps", "10"), log)
        reader = transport.reader()
        try:
            chunks = _drain(reader, lambda got: len(got) >= 3, START_S)
            before = max(c.sequence for c in chunks)
            server.restart(down_s=1.0)  # the reader stays: it reconnects, as a learner's does
            # A retried send whose first try landed: the same chunk twice in the stream.
            writer = transport.writer()
            writer._link.client.xadd(transport.stream, {b"d": encode(chunks[-1], CARTPOLE_SPEC)})
            writer.close()
            chunks += _drain(reader, lambda got: sum(c.sequence > before for c in got) >= 3, 60)
            assert proc.poll() is None, log.read_text()[-3000:]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
            counters = _counters(log)
            chunks += _drain(reader, lambda got: _steps(chunks) + _steps(got) >= counters["env_steps"], 30)
            assert reader.stats.duplicates >= 1
        finally:
            reader.close()
    assert "reconnecting" in log.read_text()  # it did lose the server
    ids = [c.sequence for c in chunks]
    assert len(ids) == len(set(ids)) == counters["chunks"]  # every chunk once, none lost
    assert sorted(ids) == list(range(min(ids), min(ids) + len(ids)))
    assert _steps(chunks) == counters["env_steps"]


@pytest.mark.slow
def test_signal_stops_an_actor_blocked_by_back_pressure(tmp_path: Path) -> None:
    """Nobody drains the spool: the actor waits for room; SIGTERM still ends it, exit 0."""
    policy, url = f"file://{tmp_path}/policy", f"file://{tmp_path}/spool"
    publish_cartpole_policy(policy, 1)
    ready = tmp_path / "spool" / "shard-0" / "ready"
    log = tmp_path / "actor.log"
    with children() as kids:
        args = _actor_cli(tmp_path, url, policy, "--queued-chunks-per-actor", "1", "--chunk-steps", "4")
        proc = kids.cli(args, log)
        wait_for(lambda: ready.is_dir() and any(ready.iterdir()), START_S, "the first chunk",
                 explain=lambda: log.read_text()[-3000:])
        time.sleep(0.5)  # it has made its next chunk and waits for room
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
        assert time.monotonic() - started < 15
    counters = _counters(log)
    assert counters["chunks"] == 1 and counters["send_retries"] >= 1
    assert len(list(ready.iterdir())) == 1  # the queue bound held


def _delivery_lines(path: Path) -> list[dict[str, int]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class _Pipelining:
    """A writer with ``in_flight`` chunks on the wire, their replies not read (as Redis's)."""

    in_flight = 0


def test_delivery_log_waits_until_a_pipelining_writer_confirms(tmp_path: Path) -> None:
    """The Redis fault matrix lost a chunk its actor had logged: ``send`` had returned with
    the add still in flight on a connection to a server just killed, and the actor was
    killed before the writer read the reply. A chunk is logged once the writer no longer
    has it in flight, and one it never confirms is never logged."""
    log_path = tmp_path / "actor-0.jsonl"
    log, writer, plain = actor_module._DeliveryLog(str(log_path)), _Pipelining(), object()
    chunks = [SimpleNamespace(actor_id=0, sequence=q, num_streams=1, num_steps=2) for q in range(4)]
    writer.in_flight = 1
    log.record(chunks[0], writer)
    assert _delivery_lines(log_path) == []  # sent, not confirmed
    writer.in_flight = 2
    log.record(chunks[1], writer)
    assert _delivery_lines(log_path) == []
    writer.in_flight = 1  # the reply of chunk 0 was read
    log.record(chunks[2], writer)
    assert [r["sequence"] for r in _delivery_lines(log_path)] == [0, 1]
    log.record(chunks[3], plain)  # a writer without in_flight confirms as it sends
    assert [r["sequence"] for r in _delivery_lines(log_path)] == [0, 1, 3]
    writer.in_flight = 0
    log.confirm(writer)  # closed: everything confirmed
    assert [r["sequence"] for r in _delivery_lines(log_path)] == [0, 1, 3, 2]
    assert log._waiting == {}  # writers with nothing waiting are not kept (one per actor life)
    log.close()


@pytest.mark.parametrize("kind", ["file", pytest.param("redis", marks=pytest.mark.redis)])
def test_delivery_log_lists_exactly_the_chunks_the_transport_accepted(tmp_path: Path, kind: str,
                                                                      redis_factory) -> None:
    """A full queue (nobody reads) refuses chunks: those are not in the log; a stop while
    blocked gives up on the held chunk, which is not logged either."""
    url = _transport_url(kind, tmp_path, redis_factory)
    publish_cartpole_policy(f"file://{tmp_path}/policy", 1)
    log_path = tmp_path / "audit" / "actor-1.jsonl"
    s = _settings(tmp_path, url, queued_chunks_per_actor=2, send_timeout_s=0.2, delivery_log=str(log_path))
    stop = threading.Event()
    logged_while_blocked: list[int] = []

    def stop_once_blocked() -> None:  # the queue holds 2: the actor then waits in send
        try:
            wait_for(lambda: log_path.exists() and len(_delivery_lines(log_path)) >= 2, START_S, "2 chunks")
            logged_while_blocked.append(len(_delivery_lines(log_path)))
            time.sleep(1.5)
        finally:
            stop.set()

    stopper = threading.Thread(target=stop_once_blocked, daemon=True)
    stopper.start()
    try:
        counters = run(s, stop=stop)
    finally:
        stop.set()
        stopper.join(timeout=START_S)
    # The chunks the queue took are logged while the actor waits to send the next (a
    # pipelining writer confirms them as it waits), not only once a send returns.
    assert logged_while_blocked, "the queued chunks were not logged while the actor waited in send"
    lines = _delivery_lines(log_path)
    assert len(lines) == counters["chunks"] >= 1
    assert counters["send_retries"] >= 1, counters  # the queue was full: some chunks waited or were refused
    reader = shard_transport(url, CARTPOLE_SPEC, StreamLayout(2, 4, 2).home_shard(1)).reader()
    try:
        chunks = _drain(reader, lambda got: len(got) >= len(lines), 20)
        assert reader.receive(64, timeout_s=0.2) == []
    finally:
        reader.close()
    assert [(d["actor_id"], d["sequence"], d["steps"]) for d in lines] == \
        [(c.actor_id, c.sequence, c.num_streams * c.num_steps) for c in chunks]
    assert sum(d["steps"] for d in lines) < counters["env_steps"]  # played more than was accepted


def test_delivery_log_is_appended_across_lives_and_off_by_default(tmp_path: Path) -> None:
    publish_cartpole_policy(f"file://{tmp_path}/policy", 1)
    log_path = tmp_path / "actor-1.jsonl"
    url = f"file://{tmp_path}/spool"
    for _life in range(2):
        run(_settings(tmp_path, url, max_env_steps=3 * 10, delivery_log=str(log_path)),
            stop=threading.Event())
    lines = _delivery_lines(log_path)
    assert [d["steps"] for d in lines] == [15, 15] * 2
    assert len({d["sequence"] for d in lines}) == 4
    run(_settings(tmp_path, url, max_env_steps=3 * 10), stop=threading.Event())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor-1.jsonl", "policy", "spool"]
