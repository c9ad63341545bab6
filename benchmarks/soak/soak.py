"""Soak: many light writers feed 2 learner ranks for minutes while a chaos schedule kills things.

Per transport (``redis://`` on a real redis-server on a free loopback port, then
``file://``), one run directory lives through launches of the same
``shardreplay train --auto-resume --actors 0 --remote-actors N`` command (the project's
own launcher and learners). The N writers are light remote actors forked from this
process: each runs the actor's own chunker, shard transports, send loop (retries,
reconnects, back-pressure) and delivery log (``runtime.actor.loop``), fed steps that a
real CartPole env recorded once at the start instead of an env and a policy (an actor
process with its env, policy and imports takes ~90 MiB: 256 do not fit this machine).
A supervisor loop here relaunches train whenever it exits non-zero; once ``--minutes``
are spent it stops the writers, waits until the learners drained the medium and stops
the last launch with Ctrl-C (a complete final checkpoint). Meanwhile:

- every ``--actor-kill-s`` seconds a random writer is SIGKILLed and started again (a new
  life with higher sequence numbers, as a restarted actor);
- every ``--learner-kill-s`` seconds a random learner rank is SIGKILLed (the launcher
  stops the tree and exits non-zero; the loop resumes the run with ``--auto-resume``);
- once, at ``--redis-restart-at`` of the phase, redis-server is SIGKILLed and restarted
  on its port (``appendonly yes``).

Minutes and fault times count only while chunks flow (not while a launch starts up).
Every ``--sample-s`` seconds it records env steps delivered per second (delivery logs),
the RSS of the train tree, the PSS of the writers and Redis's ``used_memory`` (also appended
to ``<dir>/<transport>/samples.jsonl`` as it goes). At the end,
the audit of ``tests/runtime/launch/test_e2e_faults.py`` (same helpers): every chunk a
writer logged as delivered is in the final checkpoint or in ``lost_chunks.jsonl`` with a
reason, none stored twice, none lost after it was acknowledged (any reason but a rejection on
arrival: a crash, or a logged chunk the replay refused); and
fairness: max / min chunks delivered per writer.

Prints one JSON line (a dict per transport). Every process it starts (the train tree,
the writers, redis-server) ends on success, failure and Ctrl-C (``TrainRun.close`` kills
the tree, writers get SIGTERM then SIGKILL and have ``PR_SET_PDEATHSIG``, redis-server
gets SIGTERM and has ``PR_SET_PDEATHSIG``).

The full hour of issue 42 item 4 (per transport)::

    nice -n 10 python benchmarks/soak/soak.py --actors 256 --minutes 60 \
        --actor-kill-s 60 --learner-kill-s 900
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.support

import psutil
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
from tests.support.redis import RedisServer, start_redis
from tests.support.train_runs import TrainRun

CHUNK_STEPS = 8
START_S = 600.0  # a launch of many actors on a loaded 2-core machine


def train_args(run_dir: Path, transport: str, actors: int, max_minutes: float) -> list[str]:
    """The one ``train --auto-resume`` command every launch of a phase runs."""
    return ["train", "--run-dir", str(run_dir), "--auto-resume", "--transport", transport,
            "--learners", "2", "--actors", "0", "--remote-actors", str(actors), "--envs-per-actor", "1",
            "--chunk-steps", str(CHUNK_STEPS),
            "--checkpoint-interval-updates", "50", "--hidden", "32", "32", "--batch-size", "32",
            "--samples-per-insert", "2", "--min-replay", "200", "--publish-interval-updates", "25",
            # Big enough that no step is overwritten: the step count then checks duplicates.
            "--replay-capacity", "4000000", "--total-env-steps", "1000000000",
            "--max-minutes", f"{max_minutes:.3f}", "--stop-return", "none", "--no-progress", "--no-plot",
            "--eval-episodes", "1", "--eval-interval-updates", "100000000",
            "--collective-timeout-s", "60", "--max-actor-restarts", "1000"]


def _delivered(logs: Path) -> int:
    if not logs.exists():
        return 0
    return sum(len(p.read_bytes().splitlines()) for p in logs.glob("actor-*.jsonl"))


def _rss_mib(procs: list[psutil.Process]) -> float:
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return round(total / 2**20, 1)


def _pss_mib(pids: list[int]) -> float:
    """Proportional set size: forked writers share most pages with this process, which
    their RSS would count once per writer."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup") as f:
            total += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    return round(total / 1024, 1)


def _redis_mib(server: RedisServer | None) -> float | None:
    if server is None:
        return None
    import redis

    with contextlib.suppress(redis.RedisError), redis.Redis(port=server.port, socket_timeout=2) as client:
        return round(int(client.info("memory")["used_memory"]) / 2**20, 2)
    return None


def record_steps(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` steps of a real CartPole (one env, random actions), as an actor's
    converter gives them to its chunker: recorded once, replayed by every writer."""
    import numpy as np

    from shardreplay.gym.steps import GymStepConverter
    from shardreplay.runtime.envs import env_source, make_vector_env

    env, obs = make_vector_env(env_source("CartPole-v1", "", ""), 1, seed)
    converter = GymStepConverter.from_env(env)
    converter.reset(obs)
    rng, steps = np.random.default_rng(seed), []
    while len(steps) < count:
        actions = rng.integers(0, 2, size=1)
        obs, reward, terminated, truncated, info = env.step(actions)
        steps += [step for step, _ids in converter.step(actions, obs, reward, terminated, truncated, info)]
    env.close()
    return steps


def writer_main(actor_id: int, actors: int, url: str, run_id: str, logs: Path, steps: list[dict[str, Any]],
                chunks_per_s: float, parent: int, spec: Any) -> None:
    """One light writer (a forked child): an actor's :class:`Shipper` (chunker, transports,
    send loop and delivery log), fed recorded steps instead of an env and a
    policy; at most ``chunks_per_s`` chunks a second (and the medium's back-pressure).
    SIGTERM: stop, wait for what is in flight, exit 0."""
    import ctypes
    import os
    import signal
    import threading

    from shardreplay.runtime.actor.loop import Shipper
    from shardreplay.runtime.routing import shard_transport
    from shardreplay.runtime.stream_layout import StreamLayout

    stop = threading.Event()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the soak stops its writers itself
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the soak
    if os.getppid() != parent:
        os._exit(1)  # the soak died before the line above
    layout = StreamLayout(actors, 1, 2)
    groups = layout.groups(actor_id)
    transports = {k: shard_transport(url, spec, k, run_id=run_id, queued_chunks_per_actor=2,
                                     actors=layout.actors_of_shard(k), compression="none") for k in groups}
    counters = {"chunks": 0, "send_retries": 0}
    shipper = Shipper(actor_id, groups, transports, CHUNK_STEPS, stop, counters, send_timeout_s=30.0,
                      delivery_log=str(logs / f"actor-{actor_id}.jsonl"))
    at, due = random.randrange(len(steps)), time.monotonic()
    try:
        while not stop.is_set():
            for _ in range(shipper.add(steps[at % len(steps)], 0)):
                due += 1.0 / chunks_per_s
                stop.wait(max(due - time.monotonic(), 0.0))
                due = max(due, time.monotonic() - 1.0)  # no burst after a long back-pressure wait
            at += 1
    finally:
        shipper.close()  # waits for what is in flight (Redis)
        os._exit(0)


class Writers:
    """The forked writer processes, by actor id: started, killed, restarted, stopped."""

    def __init__(self, actors: int, url: str, logs: Path, chunks_per_s: float, seed: int) -> None:
        self.actors, self.url, self.logs, self.chunks_per_s = actors, url, logs, chunks_per_s
        self.steps = record_steps(500, seed)
        from shardreplay.runtime.algos import algorithm
        from shardreplay.runtime.envs import describe_env, env_source

        algo = algorithm("dqn")  # the learners' spec (DQN on CartPole-v1)
        cartpole = describe_env(env_source("CartPole-v1", "", ""), algo.actions)
        self.spec = algo.transition_spec(cartpole, (32, 32))
        # What the writers import, imported once here: forked, they share these pages
        # (~70 MiB of private memory each when each child imported them itself).
        import gc

        import shardreplay.runtime.actor.loop
        import shardreplay.runtime.routing
        import shardreplay.transport.redis
        import shardreplay.transport.spool  # noqa: F401

        gc.freeze()  # the collector then leaves the shared objects' pages alone
        self.pids: dict[int, int] = {}
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, actor_id: int, run_id: str) -> None:
        """Fork the writer of ``actor_id``."""
        import os

        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                writer_main(actor_id, self.actors, self.url, run_id, self.logs, self.steps, self.chunks_per_s,
                            parent, self.spec)
            finally:
                os._exit(1)
        self.pids[actor_id] = pid

    def kill_one(self, rng: random.Random, run_id: str) -> str:
        """SIGKILL a random writer and start its next life; returns what was done."""
        import os
        import signal

        actor_id = rng.choice(sorted(self.pids))
        pid = self.pids.pop(actor_id)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        self.start(actor_id, run_id)
        return f"writer {actor_id}"

    def stop(self, timeout_s: float = 60.0) -> list[int]:
        """SIGTERM every writer, wait up to ``timeout_s``, SIGKILL the rest; returns the
        exit codes of the writers that exited by themselves."""
        import os
        import signal

        codes = []
        for pid in self.pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for pid in list(self.pids.values()):
            while time.monotonic() < deadline:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes.append(os.waitstatus_to_exitcode(status))
                    break
                time.sleep(0.05)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        self.pids.clear()
        return codes


class Phase:
    """One transport's soak: launches, chaos, samples, then the audit. Its minutes and its
    fault times count only while chunks flow (not while a launch starts)."""

    def __init__(self, kind: str, root: Path, opts: argparse.Namespace) -> None:
        self.kind, self.root, self.opts = kind, root, opts
        self.rng = random.Random(opts.seed)
        self.run_dir, self.logs, self.out = root / "run", root / "delivered", root / "out"
        self.server: RedisServer | None = None
        self.samples: list[dict[str, Any]] = []
        self.events: list[str] = []
        self.launches = 0

    def run(self, started: list[RedisServer]) -> dict[str, Any]:
        """Soak for ``--minutes``, then audit; returns this phase's figures."""
        if self.kind == "redis":
            self.server = start_redis(self.root / "redis", appendonly=True, started=started)
            transport = self.server.url
        else:
            transport = f"file://{self.root / 'spool'}"
        writers = Writers(self.opts.actors, transport, self.logs, self.opts.chunks_per_s, self.opts.seed)
        try:
            return self._launches(transport, writers)
        finally:
            writers.stop()

    def _launches(self, transport: str, writers: Writers) -> dict[str, Any]:
        t0 = time.monotonic()
        end = t0 + self.opts.minutes * 60
        next_actor = t0 + self.opts.actor_kill_s
        next_learner = t0 + self.opts.learner_kill_s
        redis_at = t0 + self.opts.redis_restart_at * self.opts.minutes * 60 if self.server else None
        last, run_id, stopped = (t0, 0), "", False
        while True:
            self.launches += 1
            # The last launch is stopped by Ctrl-C once the writers stopped and it drained.
            args = train_args(self.run_dir, transport, self.opts.actors, self.opts.minutes * 10 + 30)
            at_start, flowing = _delivered(self.logs), False
            with TrainRun(args, self.out, prefix=f"launch{self.launches}-") as run:
                while run.proc.poll() is None:
                    tick = time.monotonic()
                    time.sleep(1.0)
                    now = time.monotonic()
                    if not run_id and (self.run_dir / "run.json").exists():
                        run_id = json.loads((self.run_dir / "run.json").read_text())["run_id"]
                        for actor_id in range(self.opts.actors):
                            writers.start(actor_id, run_id)
                    if not flowing:
                        # The schedule's clock stands still while a launch starts (imports on a
                        # loaded machine): its minutes and faults count while chunks flow.
                        flowing = _delivered(self.logs) > at_start
                        paused = now - tick
                        end, next_actor = end + paused, next_actor + paused
                        next_learner += paused
                        redis_at = None if redis_at is None else redis_at + paused
                        last = (now, _delivered(self.logs))
                        continue
                    if now - last[0] >= self.opts.sample_s:
                        chunks = _delivered(self.logs)
                        self.samples.append({
                            "t_s": round(now - t0), "env_steps_per_s": round(
                                (chunks - last[1]) * CHUNK_STEPS / (now - last[0]), 1),
                            "learners_rss_mib": _rss_mib(run.descendants()),
                            "writers_pss_mib": _pss_mib(list(writers.pids.values())),
                            "redis_used_mib": _redis_mib(self.server)})
                        with open(self.root / "samples.jsonl", "a") as f:  # kept if the run is cut short
                            f.write(json.dumps(self.samples[-1]) + "\n")
                        last = (now, chunks)
                    if now >= end and not stopped:
                        stopped = True
                        writers.stop()
                        self._drain()
                        run.ctrl_c()
                        continue
                    if now >= next_actor and not stopped:
                        next_actor += self.opts.actor_kill_s
                        self.events.append(f"{now - t0:.0f}s {writers.kill_one(self.rng, run_id)}")
                    if redis_at is not None and now >= redis_at and self.server is not None:
                        redis_at = None
                        kill9_redis(self.server)
                        self.events.append(f"{now - t0:.0f}s redis-server")
                    if now >= next_learner and not stopped:
                        next_learner += self.opts.learner_kill_s
                        learners = run.learners()
                        if learners:
                            victim = self.rng.choice(learners).pid
                            with contextlib.suppress(psutil.Error):
                                psutil.Process(victim).kill()
                            self.events.append(f"{now - t0:.0f}s learner {victim}")
                code = run.wait(120)
                left = run.leftovers()
                if left:
                    raise RuntimeError(f"launch {self.launches} left processes: {left}" + run.explain())
                if code == 0:
                    summary = run.summary()
                    break
                if stopped or time.monotonic() > end + START_S:
                    raise RuntimeError(f"launch {self.launches} exited {code}" + run.explain())
                self.events.append(f"{time.monotonic() - t0:.0f}s launch {self.launches} exited {code}")
        return self.audit(summary, time.monotonic() - t0)

    def _drain(self, timeout_s: float = 120.0) -> None:
        """Wait until the learners took what the stopped writers left in the medium."""
        deadline = time.monotonic() + timeout_s
        if self.kind == "file":
            while pending_in_spool(self.root / "spool") and time.monotonic() < deadline:
                time.sleep(1.0)
        else:
            import redis

            assert self.server is not None
            with redis.Redis(port=self.server.port, socket_timeout=5) as client:
                while time.monotonic() < deadline:
                    with contextlib.suppress(redis.RedisError):
                        # Read entries stay in the stream a while: its groups' lag and pending count.
                        keys = list(client.scan_iter(_type="stream"))
                        groups = [g for key in keys for g in client.xinfo_groups(key)]
                        if all(int(g["lag"] or 0) == 0 and int(g["pending"]) == 0 for g in groups):
                            break
                    time.sleep(1.0)
        time.sleep(5.0)

    def audit(self, summary: dict[str, Any], wall_s: float) -> dict[str, Any]:
        """The loss audit and the fairness of the finished phase."""
        delivered_steps = read_delivery_logs(self.logs)
        _directory, manifest = final_checkpoint(self.run_dir)
        held = stored_identities(manifest)
        lost = read_lost(self.run_dir)
        total = account(set(delivered_steps), held, lost)
        steps, unlogged = stored_steps(held, delivered_steps, CHUNK_STEPS)
        reasons: Counter[str] = Counter()
        for r in lost:
            reasons[r.reason or "(none)"] += r.last - r.first + 1
        per_actor = Counter(actor for actor, _seq in delivered_steps)
        counts = [per_actor.get(a, 0) for a in range(self.opts.actors)]
        rates = [s["env_steps_per_s"] for s in self.samples]
        return {
            "transport": self.kind, "wall_s": round(wall_s), "launches": self.launches,
            "faults": self.events, "env_steps": summary.get("env_steps"), "updates": summary.get("updates"),
            "delivered": total.delivered, "stored": total.stored, "lost_with_reason": total.lost_with_reason,
            "lost_by_reason": dict(reasons), "unexplained": len(total.unexplained),
            "duplicate_steps": manifest.steps - steps, "stored_unlogged": unlogged,
            "acknowledged_lost": len(total.lost), "rejected_on_arrival": total.rejected,
            "dropped_steps": manifest.partial["dropped_steps"],
            "fairness_max_min": round(max(counts) / max(min(counts), 1), 2),
            "chunks_per_actor_min_median_max": [min(counts), sorted(counts)[len(counts) // 2], max(counts)],
            "env_steps_per_s_median": sorted(rates)[len(rates) // 2] if rates else None,
            "samples": self.samples}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the soak per transport; prints and returns ``{"transport": figures, ...}``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--actors", type=int, default=256)
    p.add_argument("--minutes", type=float, default=60.0, help="per transport")
    p.add_argument("--transports", default="redis,file")
    p.add_argument("--actor-kill-s", type=float, default=60.0)
    p.add_argument("--learner-kill-s", type=float, default=900.0)
    p.add_argument("--redis-restart-at", type=float, default=0.5, help="fraction of the phase")
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--chunks-per-s", type=float, default=1.0, help="most chunks a second per writer")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--dir", default=None, help="keep the runs here (default: a temporary directory)")
    opts = p.parse_args(argv)
    import signal

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)  # a SIGTERM cleans up as Ctrl-C does
    results: dict[str, Any] = {}
    started: list[RedisServer] = []
    with contextlib.ExitStack() as stack:
        root = Path(opts.dir) if opts.dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        try:
            for kind in opts.transports.split(","):
                results[kind] = Phase(kind, root / kind, opts).run(started)
        finally:
            for server in started:
                server.stop()
    print(json.dumps({"bench": "soak", "actors": opts.actors, "minutes": opts.minutes, **results}))
    return results


if __name__ == "__main__":
    main()
