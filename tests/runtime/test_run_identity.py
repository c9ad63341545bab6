"""One run's channels, versions and settings: run ids, learner lives, published settings.

- a new run on a medium an older run used never reads that run's chunks (counted);
- policy versions stay ordered across resumes, also from an older checkpoint, and an
  actor follows the learner it serves (with a warning); the lag metric shows it;
- a file publisher killed mid-write leaves no temp file once the next one starts;
- a remote actor takes the learner's settings; a contradicting flag is a one-line error.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.errors import ConfigError
from shardreplay.policy import open_publisher, open_subscriber
from shardreplay.policy.broadcast import RUN_KEY, RunInfo, pack_version, split_version
from shardreplay.policy.file_backend import FilePublisher, weights_name
from shardreplay.runtime.actor.loop import ActorSettings, run
from shardreplay.runtime.launch.launcher import prepare_run_dir
from shardreplay.runtime.learner.checkpoints import commit_resume
from shardreplay.runtime.learner.ingest import Ingestor
from shardreplay.runtime.learner.sync import agreed_settings
from shardreplay.runtime.routing import foreign_backlog, shard_transport
from shardreplay.runtime.run_identity import read_identity, upcoming_life
from shardreplay.runtime.settings import TrainSettings
from shardreplay.transport import open_transport
from tests.runtime.runtime_helpers import CARTPOLE_SPEC, IDENT_SPEC, make_chunk, redis_stream, wait_for
from tests.support.train_runs import FAST, TrainRun

START_S = 90.0  # a child imports torch and gymnasium: seconds on a loaded machine


pytestmark = pytest.mark.usefixtures("keep_torch_threads")  # conftest.py


def _start_actor(s: ActorSettings, caplog: pytest.LogCaptureFixture) -> tuple[threading.Event, dict[str, Any],
                                                                               threading.Thread]:
    """Run an actor on a thread of this process, its warnings captured; returns its stop
    flag, the dict its counters land in when it returns, and the thread."""
    stop = threading.Event()
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(run(s, stop=stop)), daemon=True)
    caplog.set_level(logging.WARNING, "shardreplay.actor")
    thread.start()
    return stop, result, thread


# -- 7: a run's channels ------------------------------------------------------------------
def _resume(run_dir: Path) -> None:
    """What ``--resume`` does to run.json: nothing before the ranks restored, then rank 0
    records the life."""
    before = read_identity(run_dir)
    settings = prepare_run_dir(TrainSettings.from_dict(dict(run_dir=str(run_dir))), True)
    assert read_identity(run_dir) == before  # not yet: a refused resume changes nothing
    commit_resume(run_dir, upcoming_life(run_dir), settings.to_dict(), restored=None)


def test_the_run_id_is_kept_by_every_start_of_a_run_dir_and_lives_are_counted(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    prepare_run_dir(TrainSettings.from_dict(dict(run_dir=str(run_dir))), False)
    first = read_identity(run_dir)
    assert first is not None and first.life == 0
    _resume(run_dir)
    prepare_run_dir(TrainSettings.from_dict(dict(run_dir=str(run_dir))), False, auto_resume=True)
    again = read_identity(run_dir)
    assert again is not None and (again.run_id, again.life) == (first.run_id, 2)
    prepare_run_dir(TrainSettings.from_dict(dict(run_dir=str(tmp_path / "other"))), False)
    other = read_identity(tmp_path / "other")
    assert other is not None and other.run_id != first.run_id and other.life == 0


def _old_chunks(transport: Any, count: int) -> None:
    """Valid CartPole chunks of actor 0 (what an old run's actor left behind)."""
    writer = transport.writer()
    for q in range(count):
        writer.send(make_chunk(0, 10_000 + q, s=4, t=8, spec=CARTPOLE_SPEC, version=64_000))
    writer.close()


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(600)
def test_a_new_run_on_a_used_redis_ingests_none_of_the_old_runs_chunks(tmp_path: Path, redis_server) -> None:
    url = redis_server.url
    # An old run's leftovers: under the stream name of before run ids, and of another run.
    _old_chunks(shard_transport(url, CARTPOLE_SPEC, 0), 12)
    _old_chunks(shard_transport(url, CARTPOLE_SPEC, 0, run_id="0ldrun"), 5)
    _publish(url, pack_version(0, 64_000), _run_meta("0ldrun", 0)).close()  # and its policy
    run_dir = tmp_path / "run"
    args = ["train", "--run-dir", str(run_dir), *FAST, "--transport", url, "--learners", "1",
            "--actors", "1", "--total-env-steps", "1200", "--hidden", "16", "--epsilon-warmup-steps", "0"]
    with TrainRun(args, tmp_path / "logs") as train:
        assert train.wait(400) == 0, train.explain()
        assert train.leftovers() == [], train.explain()
        summary = train.summary()
    client = redis.Redis.from_url(url)
    try:
        # Never read: every entry still there, nothing delivered to any consumer.
        for stream, n in (("shardreplay:chunks:0", 12), ("shardreplay:0ldrun:chunks:0", 5)):
            assert client.xlen(stream) == n
            assert all(g["last-delivered-id"] == b"0-0" and g["consumers"] == 0
                       for g in client.xinfo_groups(stream))
        assert client.exists(redis_stream(0, summary["run_id"]))  # this run's own stream
    finally:
        client.close()
    assert summary["foreign_chunks_ignored"] == 17 and summary["chunks_rejected"] == 0
    assert summary["chunks_duplicate"] == 0
    assert "17 chunk(s) of other runs wait" in train.stderr()
    assert "belongs to run 0ldrun, which has not finished" in train.stderr()
    # Its steps are its own actor's: 4 envs x whole vector steps, never the old 32-step chunks.
    assert summary["env_steps"] >= 1200


def test_a_spool_keeps_runs_apart_and_counts_the_others(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/spool"
    _old_chunks(shard_transport(url, CARTPOLE_SPEC, 0), 3)
    _old_chunks(shard_transport(url, CARTPOLE_SPEC, 0, run_id="0ldrun"), 2)
    mine = shard_transport(url, CARTPOLE_SPEC, 0, run_id="newrun")
    assert Path(mine.path) == tmp_path / "spool" / "newrun" / "shard-0"
    reader = mine.reader()
    try:
        assert reader.receive(64, timeout_s=0.2) == []
    finally:
        reader.close()
    assert foreign_backlog(url, 0, "newrun") == {str(tmp_path / "spool" / "shard-0"): 3,
                                                str(tmp_path / "spool" / "0ldrun" / "shard-0"): 2}
    assert foreign_backlog(url, 1, "newrun") == {}
    # A run dir from before run ids reads the unnamed channel: its own, not another run's.
    assert foreign_backlog(url, 0, "") == {str(tmp_path / "spool" / "0ldrun" / "shard-0"): 2}


@pytest.mark.redis
def test_the_foreign_count_on_redis_is_what_other_runs_did_not_consume(redis_server) -> None:
    """A finished run's stream keeps consumed entries until trimmed (at least the last one
    delivered): those were used, not ignored. Only unacknowledged ones count."""
    url = redis_server.url
    done = shard_transport(url, CARTPOLE_SPEC, 0, run_id="done")
    _old_chunks(done, 6)
    reader = done.reader()
    got: list[Any] = []
    wait_for(lambda: got.extend(reader.receive(64, timeout_s=0.1)) or len(got) == 6, 30,
             "the done run's chunks")
    reader.ack(got)
    reader.close()  # sends the acknowledgements
    busy = shard_transport(url, CARTPOLE_SPEC, 0, run_id="busy")
    _old_chunks(busy, 6)
    reader = busy.reader()
    first = reader.receive(3, timeout_s=5.0)
    assert len(first) == 3
    reader.ack(first[:2])  # one delivered and pending, three never delivered
    reader.close()
    client = redis.Redis.from_url(url)
    try:
        assert client.xlen(redis_stream(0, "done")) >= 1  # what the old count reported
    finally:
        client.close()
    assert foreign_backlog(url, 0, "new") == {redis_stream(0, "busy"): 4}
    assert foreign_backlog(url, 0, "busy") == {}


def test_a_new_run_on_a_used_policy_directory_is_not_pruned_by_the_old_runs_versions(tmp_path: Path) -> None:
    """The old run got to version 12; the new one starts at 0 in the same directory. Its
    files must outlive the old run's higher versions (pruning by version deleted them)."""
    url = (tmp_path / "policy").as_uri()
    old = open_publisher(url, keep=3)
    for version in (10, 11, 12):
        old.publish(version, {"w": np.zeros(3, np.float32)}, meta=_run_meta("old", 0))
    subscriber = open_subscriber(url, check_interval_s=0)
    assert subscriber.poll().version == 12  # type: ignore[union-attr]
    new = open_publisher(url, keep=3)
    new.publish(0, {"w": np.ones(3, np.float32)}, meta=_run_meta("new", 0))
    update = subscriber.poll()
    assert update is not None and (update.version, update.run_id) == (0, "new")
    assert update.weights["w"].tolist() == [1.0, 1.0, 1.0]
    assert sorted(p.name for p in (tmp_path / "policy").glob("*.safetensors")) == [weights_name(0)]
    for version in (1, 2, 3):
        new.publish(version, {"w": np.full(3, version, np.float32)}, meta=_run_meta("new", 0))
    assert sorted(p.name for p in (tmp_path / "policy").glob("*.safetensors")) == \
        [weights_name(v) for v in (1, 2, 3)]  # keep: the newest 3 of its own


# -- 9: versions across resumes -----------------------------------------------------------
def _run_meta(run_id: str, life: int, **settings: Any) -> dict[str, str]:
    train = TrainSettings.from_dict(dict(actors=1, envs_per_actor=2, chunk_steps=4, transport="file:///unused",
                          epsilon_warmup_steps=0))
    agreed = {**agreed_settings(train, 1), **settings}
    return RunInfo(run_id=run_id, life=life, env_steps=0, seed=0, transport=train.transport.url,
                   settings=agreed).to_meta()


def _publish(url: str, version: int, meta: dict[str, str], publisher: Any = None) -> Any:
    import torch

    from shardreplay.runtime.algos.networks import QNetwork

    torch.manual_seed(version % 1000)
    publisher = publisher or open_publisher(url)
    publisher.publish(version, QNetwork(4, 2, (16,)).state_dict(), meta=meta)
    return publisher


def test_versions_of_a_resumed_learner_are_newer_even_with_fewer_updates(tmp_path: Path) -> None:
    """Life 0 reached 1000 updates; life 1 resumed from the checkpoint at 825."""
    run_dir = tmp_path / "run"
    prepare_run_dir(TrainSettings.from_dict(dict(run_dir=str(run_dir))), False)
    before = pack_version(read_identity(run_dir).life, 1000)  # type: ignore[union-attr]
    _resume(run_dir)
    after = pack_version(read_identity(run_dir).life, 875)  # type: ignore[union-attr]
    assert after > before and split_version(after) == (1, 875) and split_version(before) == (0, 1000)
    url = (tmp_path / "policy").as_uri()
    subscriber = open_subscriber(url, check_interval_s=0)
    _publish(url, before, _run_meta("r", 0))
    assert subscriber.poll().version == before
    _publish(url, after, _run_meta("r", 1))  # a new publisher: the resumed learner's
    update = subscriber.poll()
    assert update is not None and update.version == after


def test_an_actor_that_held_a_higher_version_follows_the_resumed_learner_and_warns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    policy, spool = (tmp_path / "policy").as_uri(), f"file://{tmp_path}/spool"
    meta = _run_meta("r", 0)
    _publish(policy, pack_version(0, 1000), meta)
    s = ActorSettings(actor_id=0, transport=spool, policy_url=policy, hidden=(16,), seed=1,
                      policy_wait_s=30.0, policy_check_interval_s=0.02)
    stop, result, thread = _start_actor(s, caplog)
    reader = shard_transport(spool, CARTPOLE_SPEC, 0, run_id="r").reader()
    got: list[Any] = []
    try:
        def received(version: int) -> bool:
            batch = reader.receive(64, timeout_s=0.05)
            reader.ack(batch)
            got.extend(batch)
            return any(c.policy_version == version for c in got)

        wait_for(lambda: received(pack_version(0, 1000)), 60, "chunks of version 1000")
        _publish(policy, pack_version(1, 875), _run_meta("r", 1))
        wait_for(lambda: received(pack_version(1, 875)), 60, "chunks of the resumed learner's version")
    finally:
        stop.set()
        thread.join(30)
        reader.close()
    assert not thread.is_alive() and result["policy_updates"] == 1
    warnings = [r.getMessage() for r in caplog.records if "went back" in r.getMessage()]
    assert len(warnings) == 1 and "1000 (life 0)" in warnings[0] and "875 (life 1)" in warnings[0]


def test_the_policy_lag_is_not_clamped(tmp_path: Path) -> None:
    """Chunks of a policy from a previous life that got further show a negative lag."""
    transport = open_transport(f"file://{tmp_path}/spool", IDENT_SPEC, fsync=False)
    writer = transport.writer()
    writer.send(make_chunk(0, 0, version=pack_version(0, 1000)))
    writer.send(make_chunk(1, 0, version=pack_version(1, 870)))
    settings = TrainSettings.from_dict(dict(learners=1, actors=2, envs_per_actor=2, transport="file:///unused"))
    buffer = ReplayBuffer(IDENT_SPEC, num_streams=4, stream_capacity=64, window=2)
    ingestor = Ingestor(transport.reader(), buffer, settings)
    assert ingestor.drain(8, 1.0, policy_version=pack_version(1, 875)) == 16
    stats = ingestor.take_stats()
    assert stats.lag_count == 2 and stats.lag_sum == (875 - 1000) + (875 - 870)
    ingestor.close()


# -- 11: a crashed file publisher ---------------------------------------------------------
_KILLED_MID_WRITE = """
import os, sys, time
import torch
from shardreplay.policy.file_backend import FilePublisher, weights_name
os.replace = lambda *a: (print("written", flush=True), time.sleep(600))  # dies before the rename
FilePublisher(sys.argv[1]).publish(1, {"w": torch.zeros(1000)})
"""


@pytest.mark.slow  # fresh interpreters or many examples: 20-100 s at load ~9 on 2 cores
def test_a_publisher_killed_mid_write_leaves_no_temp_file_after_the_next_starts(tmp_path: Path) -> None:
    path = tmp_path / "policy"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_MID_WRITE, str(path)], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"written\n"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdout.close()  # type: ignore[union-attr]
    temps = [p.name for p in path.iterdir() if p.name.endswith(".tmp")]
    assert len(temps) == 1  # what the crash left
    (path / "unrelated.tmp").write_text("not ours")
    publisher = FilePublisher(path)
    assert sorted(p.name for p in path.iterdir()) == ["unrelated.tmp"]
    publisher.publish(1, {"w": np.zeros(3, np.float32)})
    assert sorted(p.name for p in path.iterdir() if p.name.endswith(".tmp")) == ["unrelated.tmp"]


# -- 8: the learner's settings ------------------------------------------------------------
def _actor_cli(policy: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "shardreplay", "actor", "--actor-id", "0", "--policy-url", policy,
            "--policy-wait-s", "60", *extra]


@pytest.mark.slow
def test_a_remote_actor_given_only_the_url_takes_the_learners_settings(tmp_path: Path) -> None:
    policy, spool = (tmp_path / "policy").as_uri(), f"file://{tmp_path}/spool"
    meta = _run_meta("r", 0, chunk_steps=3, envs_per_actor=2, queued_chunks_per_actor=1000)
    info = json.loads(meta[RUN_KEY])
    info["transport"] = spool
    _publish(policy, pack_version(0, 5), {RUN_KEY: json.dumps(info)})
    got = subprocess.run(_actor_cli(policy, "--max-env-steps", "12"), capture_output=True, text=True,
                         timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    counters = json.loads(got.stdout.strip().splitlines()[-1])
    reader = shard_transport(spool, CARTPOLE_SPEC, 0, run_id="r").reader()
    try:
        chunks = reader.receive(64, timeout_s=1.0)
    finally:
        reader.close()
    assert counters["env_steps"] == 12 and len(chunks) == counters["chunks"] == 2
    assert all(c.num_streams == 2 and c.num_steps == 3 for c in chunks)  # the learner's chunk shape
    assert {c.policy_version for c in chunks} == {pack_version(0, 5)}


@pytest.mark.slow  # fresh interpreters or many examples: 20-100 s at load ~9 on 2 cores
@pytest.mark.parametrize("flag, value, theirs", [("--chunk-steps", "16", "8"),
                                                 ("--epsilon-warmup-steps", "0", "8000"),
                                                 ("--queued-chunks-per-actor", "64", "2")])
def test_a_flag_contradicting_the_learner_exits_2_with_one_line(tmp_path: Path, flag: str, value: str,
                                                                  theirs: str) -> None:
    policy = (tmp_path / "policy").as_uri()
    train = TrainSettings.from_dict(dict(actors=1, transport=f"file://{tmp_path}/spool"))
    meta = RunInfo(run_id="r", life=0, env_steps=0, seed=0, transport=train.transport.url,
                   settings=agreed_settings(train, 1)).to_meta()
    _publish(policy, pack_version(0, 5), meta)
    started = time.monotonic()
    got = subprocess.run(_actor_cli(policy, flag, value, "--max-env-steps", "400"), capture_output=True,
                         text=True, timeout=300)
    assert got.returncode == 2, got.stderr[-3000:]
    errors = [ln for ln in got.stderr.splitlines() if not ln[:4].isdigit()]  # not log lines
    assert errors == [f"shardreplay actor: {flag} {value} contradicts the learner's {theirs} (published "
                      f"with the policy at {policy}): leave {flag} out to take the learner's"]
    assert "Traceback" not in got.stderr and got.stdout == ""
    assert not (tmp_path / "spool").exists()  # it sent nothing
    assert time.monotonic() - started < 120


@pytest.mark.slow
def test_an_actor_switches_to_a_new_run_that_takes_over_the_policy_url(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A new run starts again at version 0 on the same URL: the actor serves it, with its settings."""
    policy, spool = (tmp_path / "policy").as_uri(), f"file://{tmp_path}/spool"

    def meta(run_id: str, chunk_steps: int) -> dict[str, str]:
        info = json.loads(_run_meta(run_id, 0, chunk_steps=chunk_steps)[RUN_KEY])
        info["transport"] = spool
        return {RUN_KEY: json.dumps(info)}

    _publish(policy, pack_version(0, 500), meta("old", 3))
    s = ActorSettings(actor_id=0, policy_url=policy, hidden=(16,), seed=1, policy_wait_s=30.0,
                      policy_check_interval_s=0.02)
    stop, _result, thread = _start_actor(s, caplog)
    old = shard_transport(spool, CARTPOLE_SPEC, 0, run_id="old").reader()
    new = shard_transport(spool, CARTPOLE_SPEC, 0, run_id="new").reader()
    got: dict[str, list[Any]] = {"old": [], "new": []}

    def received(name: str, reader: Any) -> bool:
        batch = reader.receive(64, timeout_s=0.05)
        reader.ack(batch)
        got[name].extend(batch)
        return bool(got[name])

    try:
        wait_for(lambda: received("old", old), 60, "chunks for the old run")
        _publish(policy, pack_version(0, 0), meta("new", 5))  # a fresh publisher, version 0
        wait_for(lambda: received("new", new), 60, "chunks for the new run")
    finally:
        stop.set()
        thread.join(30)
        old.close()
        new.close()
    assert not thread.is_alive()
    assert {c.num_steps for c in got["old"]} <= {1, 2, 3} and {c.num_steps for c in got["new"]} <= {1, 5}
    assert 5 in {c.num_steps for c in got["new"]}
    assert {c.policy_version for c in got["new"]} == {pack_version(0, 0)}
    assert any("now belongs to run new (this actor served run old)" in r.getMessage() for r in caplog.records)


def test_a_remote_actor_refuses_a_run_on_the_local_transport(tmp_path: Path) -> None:
    policy = (tmp_path / "policy").as_uri()
    train = TrainSettings.from_dict(dict(actors=1))  # transport "local"
    _publish(policy, pack_version(0, 5), RunInfo(run_id="r", life=0, env_steps=0, seed=0, transport="local",
                                                 settings=agreed_settings(train, 1)).to_meta())
    with pytest.raises(ConfigError, match="uses the local transport"):
        run(ActorSettings(actor_id=0, policy_url=policy, policy_wait_s=30.0), stop=threading.Event())


@pytest.mark.slow
def test_an_actor_takes_the_new_shard_count_of_a_resumed_run(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """The run resumes on 2 learners instead of 1: actor 1 now feeds shard 1."""
    policy, spool = (tmp_path / "policy").as_uri(), f"file://{tmp_path}/spool"

    def meta(life: int, shards: int) -> dict[str, str]:
        info = json.loads(_run_meta("r", life, num_actors=2, num_shards=shards)[RUN_KEY])
        info["transport"] = spool
        return {RUN_KEY: json.dumps(info)}

    _publish(policy, pack_version(0, 100), meta(0, 1))
    s = ActorSettings(actor_id=1, policy_url=policy, hidden=(16,), seed=1, policy_wait_s=30.0,
                      policy_check_interval_s=0.02)
    stop, _result, thread = _start_actor(s, caplog)
    readers = [shard_transport(spool, CARTPOLE_SPEC, k, run_id="r").reader() for k in (0, 1)]
    got: list[list[Any]] = [[], []]

    def received(k: int) -> bool:
        batch = readers[k].receive(64, timeout_s=0.05)
        readers[k].ack(batch)
        got[k].extend(batch)
        return bool(got[k])

    try:
        wait_for(lambda: received(0), 60, "chunks on shard 0")
        _publish(policy, pack_version(1, 100), meta(1, 2))
        wait_for(lambda: received(1), 60, "chunks on shard 1")
    finally:
        stop.set()
        thread.join(30)
        for r in readers:
            r.close()
    assert not thread.is_alive()
    assert {c.policy_version for c in got[1]} == {pack_version(1, 100)}
    assert any("changed settings" in r.getMessage() for r in caplog.records)
