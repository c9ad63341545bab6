"""Transport benchmark: 2 actor processes into 1 reader, per transport vs its bare medium.

Workload: chunks of ``T=32`` steps x ``S=8`` streams, ``obs`` float32[64], ``action`` int64,
``reward`` float32, step types and discounts (about 70 KB encoded). Two spawned actor
processes send ``--chunks`` chunks each; the reader (this process) receives, decodes,
validates and acknowledges them, and with ``ingest`` also writes each chunk into a
``ReplayBuffer`` (``extend``, rows = actor x stream), receiving with ``borrow=True`` as
the learner's ``Ingestor`` does (the local ring then decodes in place). The rate is steps per second from the
start signal to the last chunk received.

Bare media move the same encoded bytes with nothing of ours in the path:

- ``local``: a ``multiprocessing.Queue`` of bytes, and our shared-memory ring's raw
  ``put``/``take`` of bytes (no codec); the ratio is against the faster of the two.
- ``file``: write + fsync + rename + directory fsync, reader list + read + unlink (the
  spool does the same durable steps).
- ``redis``: redis-py pipelined ``XADD`` (8 per round trip), reader ``XREAD``.

With ``--wal``, two more ingest cases write every received batch to the learner's
ingest write-ahead log (:class:`~shardreplay.runtime.learner.wal.IngestLog`) before
acknowledging it, as ``shardreplay train`` does: ``transport_ingest_wal`` (one
``writev`` per batch, no fsync), ``transport_ingest_wal_fsync`` (plus ``fdatasync`` per
batch) and ``transport_ingest_wal_fsync1s`` (``fdatasync`` at most once a second: what
``train`` does). The ingest cases run alternated within each repetition; ``wal_cost``,
``wal_fsync_cost`` and ``wal_fsync1s_cost`` are 1 - their steps/s over plain ingest's.

Every case runs ``--reps`` times in the same run; medians are reported. ``ratio`` is the
wall-clock rate of the transport over that of the best bare medium (target >= 0.7);
``cpu_ratio`` compares CPU microseconds per chunk (reader + actors, + redis-server for
redis) the same way, which other load on the machine does not skew (wall-clock rates on a busy 2-core machine
favour the lighter, mostly sleeping bare processes). One JSON line on stdout.

Usage::

    python benchmarks/transport/bench_transport.py                    # about two minutes on 2 cores
    python benchmarks/transport/bench_transport.py --quick            # seconds
    python benchmarks/transport/bench_transport.py --transports local,redis --reps 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
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

from shardreplay._io import fsync_dir
from shardreplay.spec import Field, Spec
from shardreplay.transport import Chunk, decode, encode, open_transport
from shardreplay.transport.local import ShmRing

S, T, ACTORS = 8, 32, 2
SPEC = Spec({"obs": Field((64,), np.float32), "action": Field((), np.int64), "reward": Field((), np.float32)})
TRANSPORTS = ("local", "file", "redis")
TARGET = 0.7
BATCH = 64  # chunks per receive (--batch; the learner takes 16: runtime.learner.sync.DRAIN_CHUNKS)


def make_chunks(actor: int, n_distinct: int = 4) -> list[Chunk]:
    """A few distinct chunks an actor cycles through (each one whole episode per stream)."""
    rng = np.random.default_rng(actor)
    st = np.ones((S, T), np.uint8)
    st[:, 0], st[:, -1] = 0, 2
    out = []
    for _ in range(n_distinct):
        steps = {"obs": rng.standard_normal((S, T, 64)).astype(np.float32),
                 "action": rng.integers(0, 6, (S, T)),
                 "reward": rng.standard_normal((S, T)).astype(np.float32),
                 "step_type": st, "discount": np.ones((S, T), np.float32)}
        out.append(Chunk(actor, 0, 0, np.arange(S, dtype=np.int64), steps))
    return out


# -- actor bodies (spawned) ---------------------------------------------------------------
def actor_transport(transport: Any, actor: int, n: int, ready: Any, go: Any, cpu_out: Any) -> None:
    """Send ``n`` chunks through a shardreplay transport (encoding each); report CPU seconds."""
    chunks = make_chunks(actor)
    writer = transport.writer()
    encode(chunks[0], SPEC)  # load the compiled kernels before timing, as the bare actors do
    ready.release()
    go.wait()
    cpu = time.process_time()
    for seq in range(n):
        c = chunks[seq % len(chunks)]
        writer.send(Chunk(actor, seq, 0, c.stream_ids, c.steps), timeout_s=120)
    writer.close()
    cpu_out.put(time.process_time() - cpu)


def actor_bare(kind: str, medium: Any, actor: int, n: int, ready: Any, go: Any, cpu_out: Any) -> None:
    """Send ``n`` pre-encoded chunks through a bare medium; report CPU seconds."""
    blobs = [encode(Chunk(actor, i, 0, c.stream_ids, c.steps), SPEC)
             for i, c in enumerate(make_chunks(actor))]
    if kind == "redis":
        import redis

        client = redis.Redis.from_url(medium)
    ready.release()
    go.wait()
    cpu = time.process_time()
    if kind == "queue":
        for i in range(n):
            medium.put(blobs[i % len(blobs)])
        medium.close()
        medium.join_thread()  # the feeder thread's work counts too
    elif kind == "ring":
        for i in range(n):
            medium.put(blobs[i % len(blobs)], None)
    elif kind == "file":
        root = Path(medium)
        for i in range(n):
            tmp, final = root / "tmp" / f"{actor}-{i}.tmp", root / "ready" / f"{actor}-{i}.chunk"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, blobs[i % len(blobs)])
            os.fsync(fd)
            os.close(fd)
            os.replace(tmp, final)
            fsync_dir(final.parent)
    elif kind == "redis":
        for start in range(0, n, 8):
            pipe = client.pipeline(transaction=False)
            for i in range(start, min(start + 8, n)):
                pipe.xadd("bare", {"d": blobs[i % len(blobs)]})
            pipe.execute()
    cpu_out.put(time.process_time() - cpu)


# -- reader loops -------------------------------------------------------------------------
def make_buffer() -> Any:
    """A buffer with a row per (actor, stream), its kernels compiled before timing starts."""
    from shardreplay.buffer.replay_buffer import ReplayBuffer

    warm = ReplayBuffer(SPEC, num_streams=ACTORS * S, stream_capacity=4096, window=2)
    c = make_chunks(0)[0]
    warm.extend(c.steps, stream_ids=c.stream_ids)  # numba compiles on first use
    d = decode(encode(c, SPEC), SPEC, max_bytes=1 << 30)  # and for read-only decoded arrays
    warm.extend(d.steps, stream_ids=d.stream_ids)
    return ReplayBuffer(SPEC, num_streams=ACTORS * S, stream_capacity=4096, window=2)


def read_transport(reader: Any, total: int, buffer: Any, wal: Any = None) -> None:
    got = 0
    while got < total:
        # Writing at once, ingest borrows the chunks as the learner's Ingestor does.
        chunks = reader.receive(BATCH, timeout_s=1.0, borrow=buffer is not None)
        if buffer is not None:
            for c in chunks:
                buffer.extend(c.steps, stream_ids=c.stream_ids + S * c.actor_id)
        if wal is not None:  # logged before the acknowledgement, as the learner does
            wal.append([(c.wire, c.actor_id, c.sequence, c.sequence - 1, S * T) for c in chunks])
        reader.ack(chunks)
        got += len(chunks)


def read_bare(kind: str, medium: Any, total: int) -> None:
    got = 0
    if kind == "queue":
        while got < total:
            medium.get()
            got += 1
    elif kind == "ring":
        while got < total:
            got += len(medium.take(64, time.monotonic() + 1.0))
    elif kind == "file":
        ready = Path(medium) / "ready"
        while got < total:
            for entry in os.scandir(ready):
                with open(entry.path, "rb") as f:
                    f.read()
                os.unlink(entry.path)
                got += 1
    elif kind == "redis":
        import redis

        client, last = redis.Redis.from_url(medium), "0"
        while got < total:
            reply = client.xread({"bare": last}, count=64, block=1000)
            if reply:
                entries = reply[0][1]
                last = entries[-1][0]
                got += len(entries)


def timed(target: Any, args_for: Any, reader: Any, total_chunks: int) -> dict[str, float]:
    """Start the actors, release them together, run ``reader``.

    Returns:
        ``steps_per_s`` (wall clock, start signal to last chunk) and the CPU microseconds
        per chunk spent by the reader and by the sending actor (``reader_cpu_us``,
        ``actor_cpu_us``): the CPU figures do not depend on other load on the machine.
        With a redis-server running (:data:`SERVER_PID`), also ``server_cpu_us``.
    """
    ctx = mp.get_context("spawn")
    ready, go, cpu_out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_for(a), ready, go, cpu_out)) for a in range(ACTORS)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            if not ready.acquire(timeout=120):
                raise RuntimeError("an actor did not start")
        server0 = _server_cpu()
        t0, cpu0 = time.perf_counter(), time.process_time()
        go.set()
        reader()
        dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        server = _server_cpu() - server0
        actor_cpu = sum(cpu_out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"actor exit codes {[p.exitcode for p in procs]}")
    out = {"steps_per_s": total_chunks * S * T / dt, "reader_cpu_us": cpu / total_chunks * 1e6,
           "actor_cpu_us": actor_cpu / total_chunks * 1e6}
    if SERVER_PID:
        out["server_cpu_us"] = server / total_chunks * 1e6
    return out


SERVER_PID = 0  # the redis-server while redis cases run: its CPU time is reported too


def _server_cpu() -> float:
    """CPU seconds the redis-server used so far (0 without one; Linux /proc)."""
    if not SERVER_PID:
        return 0.0
    with open(f"/proc/{SERVER_PID}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


# -- cases --------------------------------------------------------------------------------
class RedisServer:
    """A throw-away redis-server on a free loopback port (no persistence)."""

    def __init__(self) -> None:
        self.port = common.free_port()
        self.dir = tempfile.mkdtemp(prefix="bench-redis-")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        import redis

        client = redis.Redis.from_url(self.url)
        for _ in range(500):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def flush(self) -> None:
        import redis

        redis.Redis.from_url(self.url).flushall()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def ours(transport: Any, n: int, ingest: bool, wal_dir: Path | None = None,
         fsync: float | None = None) -> dict[str, float]:
    from shardreplay.runtime.learner.wal import IngestLog

    decode(encode(make_chunks(0)[0], SPEC), SPEC, max_bytes=1 << 30)  # compiled kernels loaded
    reader = transport.reader()
    buffer = make_buffer() if ingest else None
    if wal_dir is not None:
        shutil.rmtree(wal_dir, ignore_errors=True)
    wal = IngestLog(wal_dir, 0, 1, fsync=fsync is not None, fsync_every_s=fsync or 0.0) \
        if wal_dir is not None else None
    try:
        return timed(actor_transport, lambda a: (transport, a, n),
                     lambda: read_transport(reader, ACTORS * n, buffer, wal), ACTORS * n)
    finally:
        reader.close()
        if wal is not None:
            wal.close()
            shutil.rmtree(wal_dir, ignore_errors=True)


def bare(kind: str, medium: Any, n: int) -> dict[str, float]:
    return timed(actor_bare, lambda a: (kind, medium, a, n), lambda: read_bare(kind, medium, ACTORS * n),
                 ACTORS * n)


def fresh_dir(root: str, name: str) -> Path:
    path = Path(root) / name
    shutil.rmtree(path, ignore_errors=True)
    (path / "ready").mkdir(parents=True)
    (path / "tmp").mkdir()
    return path


def run_rep(kind: str, n: int, ingest: bool, scratch: str,
            server: RedisServer | None, ring_bytes: int = 64 << 20,
            wal: bool = False) -> dict[str, dict[str, float]]:
    """One repetition of every case of one transport: the figures of :func:`timed` per case."""
    global SERVER_PID
    SERVER_PID = server.proc.pid if kind == "redis" and server is not None else 0
    out: dict[str, dict[str, float]] = {}
    if kind == "local":
        capacity = ring_bytes
        blob = len(encode(make_chunks(0)[0], SPEC))
        out["bare_mp_queue"] = bare("queue", mp.get_context("spawn").Queue(capacity // blob), n)
        out["bare_shm_ring"] = bare("ring", ShmRing(capacity, mp.get_context("spawn")), n)
        make = lambda: open_transport("local", SPEC, capacity_bytes=capacity)  # noqa: E731
    elif kind == "file":
        out["bare_write_rename_read"] = bare("file", str(fresh_dir(scratch, "bare")), n)
        make = lambda: open_transport(fresh_dir(scratch, "spool").as_uri(), SPEC)  # noqa: E731
    else:
        assert server is not None
        server.flush()
        out["bare_xadd_xread"] = bare("redis", server.url, n)
        server.flush()
        make = lambda: open_transport(server.url, SPEC)  # noqa: E731
    out["transport"] = ours(make(), n, ingest=False)
    # (case, WAL or not, fdatasync at most every so many seconds: None never)
    cases: list[tuple[str, bool, float | None]] = [("transport_ingest", False, None)]
    if wal:
        cases += [("transport_ingest_wal_fsync", True, 0.0), ("transport_ingest_wal", True, None),
                  ("transport_ingest_wal_fsync1s", True, 1.0)]
    for name, logged, fsync in cases if ingest else []:
        if server is not None:
            server.flush()
        where = Path(scratch) / "wal" if logged else None
        out[name] = ours(make(), n, ingest=True, wal_dir=where, fsync=fsync)
    return out


def _cpu_us(case: dict[str, float]) -> float:
    """CPU microseconds per chunk of every process of a case (reader, actors, server)."""
    return sum(v for k, v in case.items() if k.endswith("_cpu_us"))


def summarize(reps: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Medians over repetitions, and each figure of ours as a ratio to the best bare medium.

    ``ratio`` compares wall-clock rates; ``cpu_ratio`` compares CPU per chunk (reader,
    actors and redis-server, bare / ours: 1.0 means our layer costs nothing), a figure that other load on
    the machine does not move. ``meets_target`` judges ``ratio_ingest`` (chunks written
    into a buffer) when that case ran, else ``ratio``.
    """
    med = {case: {k: common.median(r[case][k] for r in reps) for k in reps[0][case]} for case in reps[0]}
    bare_cases = [c for c in med if c.startswith("bare_")]
    best = max(bare_cases, key=lambda c: med[c]["steps_per_s"])
    cheapest = min(_cpu_us(med[c]) for c in bare_cases)
    result: dict[str, Any] = {
        "steps_per_s": {c: round(m["steps_per_s"]) for c, m in med.items()},
        "cpu_us_per_chunk": {c: {k.removesuffix("_cpu_us"): round(v, 1) for k, v in m.items()
                                 if k.endswith("_cpu_us")} for c, m in med.items()},
    }
    for case, suffix in (("transport", ""), ("transport_ingest", "_ingest")):
        if case in med:
            result["ratio" + suffix] = round(med[case]["steps_per_s"] / med[best]["steps_per_s"], 3)
            result["cpu_ratio" + suffix] = round(cheapest / _cpu_us(med[case]), 3)
    for case, key in (("transport_ingest_wal", "wal_cost"), ("transport_ingest_wal_fsync", "wal_fsync_cost"),
                      ("transport_ingest_wal_fsync1s", "wal_fsync1s_cost")):
        if case in med:
            result[key] = round(1 - med[case]["steps_per_s"] / med["transport_ingest"]["steps_per_s"], 3)
            result[key.replace("cost", "cpu_cost")] = round(
                _cpu_us(med[case]) / _cpu_us(med["transport_ingest"]) - 1, 3)
    # The figure is steps/s ingested into the buffer: ratio_ingest when measured.
    result["meets_target"] = result.get("ratio_ingest", result["ratio"]) >= TARGET
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__, quick="smoke run: 150 chunks per actor, 1 repetition")
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--chunks", type=int, default=None, help="chunks per actor (default 1500, quick 150)")
    p.add_argument("--reps", type=int, default=None, help="repetitions, median reported (default 3, quick 1)")
    p.add_argument("--no-ingest", action="store_true", help="skip the ReplayBuffer ingest figure")
    p.add_argument("--scratch", default=None, help="directory for spool files (default: a temp dir)")
    p.add_argument("--ring-mb", type=int, default=64, help="local ring size, ours and bare (default 64)")
    p.add_argument("--batch", type=int, default=64, help="chunks per receive (default 64; the learner's 16)")
    p.add_argument("--wal", action="store_true", help="also ingest through the learner's write-ahead log "
                   "(with and without fdatasync per batch)")
    args = p.parse_args(argv)
    args.chunks = args.chunks or (150 if args.quick else 1500)
    args.reps = args.reps or (1 if args.quick else 3)
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if set(args.transports) - set(TRANSPORTS):
        p.error(f"--transports: choose from {TRANSPORTS}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    global BATCH
    BATCH = args.batch
    scratch = args.scratch or tempfile.mkdtemp(prefix="bench-transport-")
    load_start = common.loadavg()
    results: dict[str, Any] = {}
    server = None
    try:
        if "redis" in args.transports:
            if shutil.which("redis-server") is None:
                results["redis"] = {"missing": "redis-server not installed"}
                args.transports.remove("redis")
            else:
                server = RedisServer()
        for kind in args.transports:
            reps = []
            for _ in range(args.reps):  # each repetition on stderr as it ends (a run cut short keeps them)
                reps.append(run_rep(kind, args.chunks, not args.no_ingest, scratch, server,
                                    args.ring_mb << 20, wal=args.wal))
                print(json.dumps({kind: {c: round(v["steps_per_s"]) for c, v in reps[-1].items()}}),
                      file=sys.stderr, flush=True)
            results[kind] = summarize(reps)
    finally:
        if server is not None:
            server.stop()
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    line = {
        "bench": "transport",
        "workload": {"actors": ACTORS, "streams": S, "steps": T, "obs": "float32[64]",
                     "chunk_bytes": len(encode(make_chunks(0)[0], SPEC)), "chunks_per_actor": args.chunks,
                     "reps": args.reps, "batch": args.batch, "wal": args.wal},
        "results": results,
        "target_ratio": TARGET,
        "machine": {"python": common.python(), "cpus": common.cpus(),
                    "platform": platform.platform(), "loadavg_start": load_start,
                    "loadavg_end": common.loadavg()},
    }
    common.emit_line(line, args.out)


if __name__ == "__main__":
    sys.exit(main())
