"""Faults under a running ``shardreplay train``: an actor SIGKILLed, a corrupt chunk, and
(Redis) the server restarted under the learner and its actors.

Training goes on through all of it and ends with exit 0: the killed actor is restarted,
nothing partial is ingested (the summary counts exactly the one chunk we corrupted), the
learner and the actors reconnect to the restarted server (policies go through it too),
the final acknowledgements reach the server, ``metrics.csv`` carries a sensible
``policy_lag``, ``--keep-rollouts`` kept exactly the steps stored, and no process is left
(``tests.support.train_runs.TrainRun``).
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
import redis

from shardreplay.runtime.learner.wal import iter_rollouts
from shardreplay.runtime.run_identity import read_identity
from tests.runtime.runtime_helpers import kill9, redis_stream
from tests.support.train_runs import FAST, TrainRun, metrics_rows, training, wait_until

pytestmark = pytest.mark.distributed
START_S = 150.0
# The faults come once training starts (a few hundred steps in), then 3,000 more steps must
# come: the budget leaves room for both and ends the run soon after (30,000 cost minutes).
BUDGET = 12000


def _env_steps(run_dir: Path) -> int:
    rows = metrics_rows(run_dir)
    return int(rows[-1]["env_steps"]) if rows else 0


def _check_policy_lag(run_dir: Path, publish_interval: int) -> None:
    """policy_lag = mean over a row's chunks of (current version - chunk's version), in
    updates: filled whenever chunks came in, never negative, bounded by the updates done,
    and positive once the policy moves."""
    rows = metrics_rows(run_dir)
    prev = 0
    lags = []
    for row in rows:
        steps, updates = int(row["env_steps"]), int(row["updates"])
        if steps > prev:
            assert row["policy_lag"] != "", row
            lag = float(row["policy_lag"])
            assert 0 <= lag <= updates, row
            lags.append(lag)
        prev = steps
    assert lags and max(lags) > 0, rows
    # Actors check for weights every 0.2 s and hold two chunks at most: well under
    # 50 publish intervals behind on average.
    assert sum(lags) / len(lags) < 50 * publish_interval, lags


def _corrupt(kind: str, spool: Path | None, url: str | None, run_id: str) -> None:
    garbage = b"SRCK" + bytes(60)  # a chunk prefix, then nothing that adds up
    if kind == "file":
        assert spool is not None
        (spool / run_id / "shard-0" / "ready" / "0000000000-00000000000000000000.chunk").write_bytes(garbage)
    else:
        client = redis.Redis.from_url(url)
        client.xadd(redis_stream(0, run_id), {b"d": garbage})
        client.close()


@pytest.mark.timeout(420)
@pytest.mark.parametrize("kind", [pytest.param("redis", marks=pytest.mark.redis),
                                  pytest.param("file", marks=pytest.mark.slow)])
def test_training_goes_on_through_actor_kill_corrupt_chunk_and_redis_restart(
        tmp_path: Path, kind: str, redis_factory) -> None:
    server = redis_factory(appendonly=True) if kind == "redis" else None
    spool = tmp_path / "spool" if kind == "file" else None
    transport = server.url if server is not None else f"file://{spool}"
    run_dir = tmp_path / "run"
    args = ["train", "--run-dir", str(run_dir), *FAST, "--transport", transport, "--learners", "1",
            "--actors", "2", "--envs-per-actor", "2", "--hidden", "32", "32", "--samples-per-insert", "4",
            "--total-env-steps", str(BUDGET), "--publish-interval-updates", "10", "--keep-rollouts"]
    with TrainRun(args, tmp_path / "logs") as run:
        wait_until(lambda: training(run_dir) and len(run.actors()) == 2, START_S, "training", run)
        victim = run.actors()[0].pid
        kill9(victim)
        run_id = read_identity(run_dir).run_id  # type: ignore[union-attr]  # the run's channels
        _corrupt(kind, spool, transport, run_id)
        if server is not None:
            server.restart(down_s=1.0)
        at_restart = _env_steps(run_dir)
        # Both sides came back: steps keep coming, and the killed actor was replaced.
        wait_until(lambda: _env_steps(run_dir) > at_restart + 3000, START_S, "steps after the faults", run)
        wait_until(lambda: len(run.actors()) == 2 and victim not in [a.pid for a in run.actors()],
                   START_S, "the killed actor's replacement", run)
        assert run.wait(300) == 0, run.explain()
        summary = run.summary()
        assert run.leftovers() == [], run.explain()
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE
    assert summary["env_steps"] >= BUDGET
    assert summary["actor_restarts"] >= 1
    assert summary["chunks_rejected"] == 1, summary  # ours; the killed actor left nothing partial
    # Removed from the medium unstored: listed in lost_chunks.jsonl with its reason.
    lost = [json.loads(line) for line in (run_dir / "lost_chunks.jsonl").read_text().splitlines()]
    assert [(r["chunks"], r["reason"].startswith("rejected by the transport")) for r in lost] == [(1, True)]
    assert "Traceback" not in run.stderr(), run.explain()
    _check_policy_lag(run_dir, publish_interval=10)
    # --keep-rollouts through the faults: exactly the steps stored, each chunk once.
    kept = [(k.chunk.identity, k.chunk.num_streams * k.chunk.num_steps) for k in iter_rollouts(run_dir)]
    assert len({i for i, _ in kept}) == len(kept) and sum(n for _, n in kept) == summary["env_steps"]
    if server is not None:
        client = redis.Redis.from_url(server.url)
        # The learner's last acknowledgements went out before it exited: a resumed run
        # would get nothing again.
        assert client.xpending(redis_stream(0, run_id), "learners")["pending"] == 0
        client.close()
    else:
        assert spool is not None
        quarantined = sorted(p.name for p in (spool / run_id / "shard-0" / "quarantine").iterdir())
        assert quarantined == ["0000000000-00000000000000000000.chunk",
                               "0000000000-00000000000000000000.chunk.reason"]
