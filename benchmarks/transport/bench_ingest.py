"""Ingest at Ape-X scale on one machine: many writers of Pong frames into one learner rank.

Each writer is a light process (numpy and shardreplay's transport, no torch, no emulator)
that replays a recorded Pong trajectory (``bench_wire_frames.record_pong``: 84x84
grayscale, frame skip 4, 4-frame stacks) through the real actor-side path: it builds
chunks of ``--chunk-steps`` steps and sends them with the transport's writer (encoding,
packing on ``file://`` and Redis, back-pressure). The learner (this process) receives,
decodes and writes them into a prioritized :class:`~shardreplay.ReplayBuffer` with a
``frame_stack`` field, one row per writer, and between receives samples batches of
``--batch`` and updates their priorities, as a learner does.

Reported per (transport, writers), as one JSON line at the end (and a progress line per
case on stderr): steps/s and MB/s (bytes on the medium) ingested, learner batches/s,
the learner's RSS at the start and end of the timed part, lost chunks (sent and
acknowledged by the medium but never received after the writers stop and the reader
drains; must be 0) and fairness (per-writer accepted steps, max over min).

    python benchmarks/transport/bench_ingest.py --quick       # seconds: 8 writers, local
    python benchmarks/transport/bench_ingest.py               # 8, 32, 128 writers x local, file, redis
    python benchmarks/transport/bench_ingest.py --writers 32 --transports local --seconds 600  # RSS, 10 min

Needs the ``atari`` extra for the frames (``pip install -e .[atari]``; recorded once into
``.bench/pong_frames.npz``) and ``redis-server`` on the PATH for ``redis``.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import common

HERE = Path(__file__).resolve().parent
FRAMES = common.REPO / ".bench" / "pong_frames.npz"


def spec() -> Any:
    from shardreplay.spec import Field, Spec

    return Spec({"obs": Field((4, 84, 84), np.uint8, frame_stack=True), "action": Field((), np.int64),
                 "reward": Field((), np.float32)})


def trajectory(frames: int) -> tuple[np.ndarray, np.ndarray]:
    """The recorded Pong stacks and step types (recorded once, then read from .bench/)."""
    if not FRAMES.exists():
        from bench_wire_frames import record_pong

        FRAMES.parent.mkdir(exist_ok=True)
        obs, types = record_pong(frames, seed=0)
        np.savez(FRAMES, obs=obs, step_type=types)
    data = np.load(FRAMES)
    return data["obs"], data["step_type"]


def writer_main(transport: Any, actor: int, obs: np.ndarray, types: np.ndarray, chunk_steps: int,
                go: Any, stop: Any, sent: Any) -> None:
    """Send chunks of the trajectory (each writer from its own offset) until ``stop``."""
    from shardreplay.errors import TransportTimeout
    from shardreplay.transport.codec import Chunk

    writer = transport.writer()
    n = len(obs) - chunk_steps
    at, seq = (actor * 997) % n, 0
    go.wait()
    while not stop.is_set():
        t = slice(at, at + chunk_steps)
        steps = {"obs": obs[t][None], "action": np.zeros((1, chunk_steps), np.int64),
                 "reward": np.zeros((1, chunk_steps), np.float32), "step_type": types[t][None],
                 "discount": np.ones((1, chunk_steps), np.float32)}
        if seq == 0:
            steps["step_type"] = steps["step_type"].copy()
            steps["step_type"][0, 0] = 0  # a writer's first step starts an episode
        try:
            writer.send(Chunk(actor, seq, 0, np.array([0]), steps), timeout_s=0.2)
        except TransportTimeout:
            continue  # back-pressure: try the same chunk again (or stop)
        seq += 1
        sent[actor] = seq
        at = at + chunk_steps if at + 2 * chunk_steps < n else 0
    with contextlib.suppress(Exception):
        writer.close()


@contextlib.contextmanager
def medium(kind: str, scratch: Path, writers: int, chunk_bytes: int) -> Any:
    """The transport for one case (a redis-server of its own for ``redis``)."""
    from shardreplay.transport import open_transport

    sp = spec()
    if kind == "local":
        yield open_transport("local", sp, capacity_bytes=max(64 << 20, 4 * writers * (chunk_bytes + 8)))
        return
    if kind == "file":
        d = scratch / f"spool-{writers}"
        yield open_transport(d.absolute().as_uri(), sp, queued_chunks_per_actor=4, compression="lz4",
                             fsync=False)
        shutil.rmtree(d, ignore_errors=True)
        return
    port = common.free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        import redis

        client = redis.Redis(port=port)
        for _ in range(100):
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    break
            time.sleep(0.05)
        yield open_transport(f"redis://127.0.0.1:{port}/0", sp, max_len=4 * writers, compression="lz4")
    finally:
        proc.terminate()
        proc.wait(10)


def learner_loop(reader: Any, buffer: Any, deadline: float, batch: int, stats: dict[str, Any],
                 totals: dict[str, int], ingest_ms: float = 20.0) -> None:
    """Receive into the buffer for up to ``ingest_ms`` (or until nothing waits), then
    sample one batch and update its priorities; repeat until ``deadline``."""
    rng = np.random.default_rng(0)
    while (now := time.monotonic()) < deadline:
        until = now + ingest_ms / 1000
        while time.monotonic() < until:
            chunks = reader.receive(64, timeout_s=0.005, borrow=True)
            if not chunks:
                break
            for c in chunks:
                buffer.extend(c.steps, stream_ids=np.array([c.actor_id]))
                stats["steps"] += c.num_steps
                stats["per_writer"][c.actor_id] += c.num_steps
            reader.ack(chunks)
            stats["chunks"] += len(chunks)
            totals["chunks"] += len(chunks)
        if len(buffer) >= batch:
            b = buffer.sample(batch)
            buffer.update_priorities(b.keys, rng.random(batch) + 0.01)
            stats["batches"] += 1


def drain(reader: Any, totals: dict[str, int]) -> int:
    """Receive what is still in the medium after the writers stopped; how many."""
    got = 0
    while True:
        chunks = reader.receive(64, timeout_s=1.0)
        if not chunks:
            return got
        reader.ack(chunks)
        got += len(chunks)
        totals["chunks"] += len(chunks)


def rss_mb() -> float:
    import psutil

    return float(psutil.Process().memory_info().rss / 2**20)


def new_stats(writers: int) -> dict[str, Any]:
    return {"steps": 0, "chunks": 0, "batches": 0, "per_writer": np.zeros(writers, np.int64)}


def run_case(kind: str, writers: int, seconds: float, chunk_steps: int, batch: int, capacity: int,
             scratch: Path, obs: np.ndarray, types: np.ndarray, ingest_ms: float) -> dict[str, Any]:
    """One transport and number of writers: the figures of the module docstring."""
    from shardreplay.buffer.replay_buffer import ReplayBuffer
    from shardreplay.transport.codec import Chunk, encode

    sp = spec()
    probe = {"obs": obs[:chunk_steps][None], "action": np.zeros((1, chunk_steps), np.int64),
             "reward": np.zeros((1, chunk_steps), np.float32), "step_type": types[:chunk_steps][None],
             "discount": np.ones((1, chunk_steps), np.float32)}
    chunk_bytes = len(encode(Chunk(0, 0, 0, np.array([0]), probe), sp))
    ctx = mp.get_context("fork")  # the writers share the trajectory's pages with this process
    totals = {"chunks": 0}
    with medium(kind, scratch, writers, chunk_bytes) as transport:
        rows = max(capacity // writers, 4 * chunk_steps)
        buffer = ReplayBuffer(sp, num_streams=writers, stream_capacity=rows,
                              window=2, sampler="prioritized", seed=0)
        go, stop = ctx.Event(), ctx.Event()
        sent = ctx.Array("q", writers, lock=False)
        procs = [ctx.Process(target=writer_main, args=(transport, a, obs, types, chunk_steps, go, stop, sent),
                             daemon=True) for a in range(writers)]
        for p in procs:
            p.start()
        reader = transport.reader()
        try:
            go.set()
            learner_loop(reader, buffer, time.monotonic() + min(5.0, seconds / 4), batch, new_stats(writers),
                         totals, ingest_ms)  # warm-up: compiles, fills the medium
            stats = new_stats(writers)
            rss0, t0, c0 = rss_mb(), time.monotonic(), time.process_time()
            learner_loop(reader, buffer, t0 + seconds, batch, stats, totals, ingest_ms)
            wall, cpu, rss1 = time.monotonic() - t0, time.process_time() - c0, rss_mb()
            stop.set()
            left = drain(reader, totals)  # the writers stop while this drains, never blocked
        finally:
            stop.set()
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join()
        left += drain(reader, totals)
        reader.close()
    per = stats["per_writer"]
    return {"transport": kind, "writers": writers, "seconds": round(wall, 1),
            "steps_per_s": round(stats["steps"] / wall),
            "mb_per_s_whole_stacks": round(stats["chunks"] * chunk_bytes / wall / 1e6, 1),
            "learner_batches_per_s": round(stats["batches"] / wall, 1),
            "learner_cpu_share": round(cpu / wall, 2),
            "rss_mb_start": round(rss0), "rss_mb_end": round(rss1),
            "fairness_max_over_min": round(float(per.max() / max(int(per.min()), 1)), 2),
            "sent_chunks": int(sum(sent)), "received_chunks": totals["chunks"], "drained_after_stop": left,
            "lost_chunks": int(sum(sent)) - totals["chunks"]}


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(__doc__, quick="8 writers, local, 5 s")
    ap.add_argument("--writers", default="8,32,128", help="comma-separated writer counts (default 8,32,128)")
    ap.add_argument("--transports", default="local,file,redis", help="default local,file,redis")
    ap.add_argument("--seconds", type=float, default=20.0, help="timed seconds per case (default 20)")
    ap.add_argument("--chunk-steps", type=int, default=32, help="steps per chunk (default 32)")
    ap.add_argument("--batch", type=int, default=512, help="learner batch size (default 512)")
    ap.add_argument("--capacity", type=int, default=200_000, help="replay steps in all (default 200,000)")
    ap.add_argument("--ingest-ms", type=float, default=20.0,
                    help="the learner receives for up to this long between two sampled batches (default 20)")
    args = ap.parse_args(argv)
    if args.quick:
        args.writers, args.transports, args.seconds = "8", "local", 5.0
    obs, types = trajectory(4000)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as scratch:
        for kind in args.transports.split(","):
            for writers in (int(w) for w in args.writers.split(",")):
                case = run_case(kind, writers, args.seconds, args.chunk_steps, args.batch, args.capacity,
                                Path(scratch), obs, types, args.ingest_ms)
                print(json.dumps(case), file=sys.stderr, flush=True)
                results.append(case)
    common.emit_line({"bench": "ingest", "frames": "ALE/Pong-v5 84x84x4 uint8", "cores": common.cpus(),
                      "load_avg": common.loadavg(), "cases": results}, args.out)


if __name__ == "__main__":
    main()
