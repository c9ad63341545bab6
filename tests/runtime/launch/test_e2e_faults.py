"""Nothing lost, nothing stuck: ``shardreplay train`` (2 learners, 2 actors) under SIGKILLs.

Per transport (``file://`` and ``redis://``), one run directory lives through
``TRIALS`` launches of the same ``train --auto-resume`` command. In each, at moments
drawn from a seeded RNG after both actors run, one actor is SIGKILLed (its learner
restarts it), redis-server is SIGKILLed and restarted on its port with
``appendonly yes`` (Redis only), and last one learner rank is SIGKILLed, once the
learners' ingest logs of this life hold chunks that no checkpoint holds (so the next
life must replay them: the medium forgot them when they were acknowledged): the launcher
must then exit non-zero and leave no process. A final launch ends cleanly (its time
budget), and then every chunk an actor logged as delivered (``--delivery-log-dir``)
must be in the final complete checkpoint, none stored twice, and the checkpoint's step
count the sum of the stored chunks'. None may be in ``lost_chunks.jsonl``: a learner
acknowledges a chunk only once its write-ahead log holds it, and the next life replays
that log (:mod:`shardreplay.runtime.learner.wal`), so a logged chunk the replay rejects
(or a crashed learner's) is a loss; and the run's own actors send nothing to reject on
arrival. The log the final launch leaves holds only chunks its final checkpoint holds
(kept for a resume that would find that checkpoint damaged).

The counts per trial (chunks delivered during that launch, and where they went) are
printed (``pytest -s``) for the record. ``SHARDREPLAY_E2E_TRIALS`` lowers the number of
trials (5) while debugging.
"""

from __future__ import annotations

import os
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest

from shardreplay.runtime.learner.wal import LogScan, log_files, read_logs
from shardreplay.transport.redis import RedisWriter
from tests.runtime.e2e_helpers import (
    account,
    final_checkpoint,
    kill9_redis,
    pending_in_spool,
    read_delivery_logs,
    read_lost,
    stored_identities,
    stored_steps,
)
from tests.runtime.runtime_helpers import kill9
from tests.support.train_runs import TrainRun, wait_until

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# Fewer trials (e.g. 1) while debugging the harness itself.
TRIALS = int(os.environ.get("SHARDREPLAY_E2E_TRIALS", "5"))
SEEDS = {"file": [101, 102, 103, 104, 105], "redis": [201, 202, 203, 204, 205]}
START_S = 150.0  # five processes import torch on a loaded 2-core machine
EXIT_S = 90.0  # a learner died: the launcher stops the tree and exits
WINDOW_S = 5.0  # faults fall within this many seconds after both actors run
ENVS, CHUNK_STEPS = 2, 8
FLOWING_CHUNKS = 4  # delivered in a launch before its fault moments start
_OPEN_SEGMENT = re.compile(r"shard-\d+\.\d+-(\d+)\.wal")  # a learner's (pid) unsealed log segment


def _args(run_dir: Path, transport: str, logs: Path, max_minutes: float) -> list[str]:
    return ["train", "--run-dir", str(run_dir), "--auto-resume", "--transport", transport,
            "--learners", "2", "--actors", "2", "--envs-per-actor", str(ENVS),
            "--chunk-steps", str(CHUNK_STEPS), "--delivery-log-dir", str(logs),
            "--checkpoint-interval-updates", "10", "--hidden", "32", "32", "--batch-size", "32",
            "--samples-per-insert", "2", "--min-replay", "200", "--publish-interval-updates", "10",
            # Big enough that no step is overwritten: the step count then checks duplicates.
            "--replay-capacity", "400000", "--total-env-steps", "100000000",
            "--max-minutes", str(max_minutes), "--stop-return", "none", "--no-progress", "--no-plot",
            "--eval-episodes", "1", "--eval-interval-updates", "1000000",
            "--collective-timeout-s", "20", "--max-actor-restarts", "5"]


def _lines(logs: Path) -> int:
    return sum(len(p.read_bytes().splitlines()) for p in logs.glob("actor-*.jsonl"))


def _kill_an_actor(run: TrainRun, rng: random.Random) -> str:
    wait_until(lambda: len(run.actors()) == 2, START_S, "two live actors", run)
    victim = rng.choice(run.actors()).pid
    kill9(victim)
    return f"actor pid {victim}"


def _logged_past_checkpoints(pid: int, ingest: Path) -> int:
    """Chunks in learner ``pid``'s open log segment: logged and acknowledged since its last
    checkpoint began (a save seals the open segment first), so in no checkpoint part."""
    mine = [p for p in log_files(ingest) if (m := _OPEN_SEGMENT.fullmatch(p.name)) and m.group(1) == str(pid)]
    return sum(1 for _ in read_logs(mine, LogScan()))


def _kill_a_learner(run: TrainRun, rng: random.Random, ingest: Path) -> str:
    victim = rng.choice(run.learners()).pid
    # Its own log: a survivor's chunks would be in the part it saves as it stops (and a
    # background save the victim had begun may complete that checkpoint). The medium forgot
    # these chunks when they were acknowledged: the next life has them only from the replay.
    logged = wait_until(lambda: _logged_past_checkpoints(victim, ingest), START_S,
                        f"chunks logged past learner {victim}'s last checkpoint", run)
    kill9(victim)
    return f"learner pid {victim} ({logged} chunks logged past its checkpoint)"


def _trial(args: list[str], log_dir: Path, prefix: str, rng: random.Random, server: Any) -> list[str]:
    """One launch, killed as described in the module docstring; returns what was done."""
    faults: list[tuple[float, str]] = [(rng.uniform(0, WINDOW_S), "actor")]
    if server is not None:
        faults.append((rng.uniform(0, WINDOW_S), "redis"))
    faults.sort()
    faults.append((faults[-1][0] + rng.uniform(1.0, WINDOW_S / 2), "learner"))
    done = []
    logs = Path(args[args.index("--delivery-log-dir") + 1])
    ingest = Path(args[args.index("--run-dir") + 1]) / "ingest"
    at_start = _lines(logs)
    with TrainRun(args, log_dir, prefix=prefix) as run:
        # Moments count from when chunks flow, not from the launch (imports take a while).
        wait_until(lambda: len(run.actors()) == 2 and _lines(logs) >= at_start + FLOWING_CHUNKS,
                   START_S, "chunks from both actors", run)
        t0 = time.monotonic()
        for at, what in faults:
            time.sleep(max(t0 + at - time.monotonic(), 0.0))
            assert run.proc.poll() is None, f"the run exited ({run.proc.returncode}) before the " \
                f"{what} kill" + run.explain()
            if what == "actor":
                done.append(f"{at:.1f}s {_kill_an_actor(run, rng)}")
            elif what == "redis":
                kill9_redis(server)
                done.append(f"{at:.1f}s redis-server")
            else:
                done.append(f"{at:.1f}s {_kill_a_learner(run, rng, ingest)}")
        code = run.wait_explained(EXIT_S, f"{prefix}: the launcher did not exit after a learner rank's death "
                                  "(issue 10, item d)")
        assert code != 0, f"{prefix}: a learner rank died, yet the launcher exited 0" + run.explain()
        left = run.leftovers()
        assert left == [], f"{prefix}: processes left after the launcher exited: {left}" + run.explain()
    return done


def _final(args: list[str], log_dir: Path) -> dict[str, Any]:
    with TrainRun(args, log_dir, prefix="final-") as run:
        code = run.wait(300)
        assert code == 0, "the final launch did not end cleanly" + run.explain()
        left = run.leftovers()
        assert left == [], f"final: processes left after the launcher exited: {left}" + run.explain()
        return run.summary()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["file", pytest.param("redis", marks=pytest.mark.redis)])
def test_nothing_lost_nothing_stuck_under_sigkills(tmp_path: Path, kind: str, redis_factory) -> None:
    server = redis_factory(appendonly=True) if kind == "redis" else None
    spool = tmp_path / "spool"
    transport = server.url if server is not None else f"file://{spool}"
    run_dir, logs, out = tmp_path / "run", tmp_path / "delivered", tmp_path / "out"
    trials = []
    for i, seed in enumerate(SEEDS[kind][:TRIALS]):
        before = set(read_delivery_logs(logs)) if logs.exists() else set()
        faults = _trial(_args(run_dir, transport, logs, 4.0), out, f"trial{i}-", random.Random(seed),
                        server)
        delivered = set(read_delivery_logs(logs)) - before
        trials.append((f"trial {i} (seed {seed}; {', '.join(faults)})", delivered))
    before = set(read_delivery_logs(logs))
    summary = _final(_args(run_dir, transport, logs, 0.15), out)
    delivered_steps = read_delivery_logs(logs)
    trials.append(("final (clean)", set(delivered_steps) - before))

    _directory, manifest = final_checkpoint(run_dir)
    held = stored_identities(manifest)
    lost = read_lost(run_dir)
    total = account(set(delivered_steps), held, lost)
    for name, identities in trials:
        print(account(identities, held, lost).line(f"{kind} {name}"))
    steps, unlogged = stored_steps(held, delivered_steps, ENVS * CHUNK_STEPS)
    reasons: dict[str, int] = {}
    for r in lost:
        reason = r.reason[:80]  # an exception's message may follow; its start names the cause
        reasons[reason] = reasons.get(reason, 0) + r.last - r.first + 1
    print(total.line(f"{kind} all"), f"duplicate_steps={manifest.steps - steps}",
          f"stored_unlogged={unlogged} checkpoint={manifest.checkpoint_id} steps={manifest.steps}",
          f"partial={manifest.partial}", f"env_steps={summary['env_steps']}", f"lost_by_reason={reasons}",
          f"log_replayed={summary['ingest_log_replayed']} log_bytes_peak={summary['ingest_log_peak_bytes']}")
    left = pending_in_spool(spool) if kind == "file" else set()
    assert not [r for r in lost if not r.reason], f"lost chunks without a reason: {lost}"
    # Stored and acknowledged (logged), then in no checkpoint and no replay: docs/semantics.md's
    # "lost", whatever its reason says (a crashed learner's, one the replay rejected).
    assert total.lost == [], (f"{len(total.lost)} delivered chunks were acknowledged, then lost, e.g. "
                              f"{total.lost[:3]}; lost_by_reason={reasons}")
    assert total.rejected == 0, f"{total.rejected} chunks of the run's actors rejected on arrival: {reasons}"
    # The final checkpoint is complete and holds everything: what the log keeps (for a
    # fallback to the checkpoint before it) a resume from it would find held.
    kept = {(r.actor_id, r.sequence) for r in read_logs(log_files(run_dir / "ingest"), LogScan())}
    assert kept <= held, f"{len(kept - held)} logged chunks not in the final checkpoint: " \
        f"{sorted(kept - held)[:5]}"
    assert total.unexplained == [], (
        f"{len(total.unexplained)} delivered chunks are neither in the final checkpoint nor "
        f"lost with a reason, e.g. {total.unexplained[:5]}; still in the spool: "
        f"{len(left & set(total.unexplained))}")
    assert manifest.partial["dropped_steps"] == 0, manifest.partial
    # At most the chunks in flight of each actor life a trial ends (the one killed, the two
    # stopped by a learner's death): one for the spool, the writer's window for Redis,
    # whose delivery log waits for XADD's replies.
    in_flight = 1 if kind == "file" else RedisWriter.MAX_IN_FLIGHT
    assert unlogged <= 3 * in_flight * len(trials), f"{unlogged} stored chunks no actor logged as delivered"
    assert manifest.steps == steps, (
        f"the checkpoint holds {manifest.steps} steps, its distinct stored chunks {steps}: "
        "duplicates or lost steps inside it")
