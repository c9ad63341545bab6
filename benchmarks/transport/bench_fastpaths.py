"""Are the transport's two hand-made fast paths worth keeping? Each against the plain path,
side by side in the same run.

- ``ring``: the local ring's reader on x86-64 reads ``head`` and moves ``tail`` without
  the ring lock (``transport.local._ORDERED_STORES``). The plain path takes the lock for both,
  as on other machines. Only the reader (this process) differs; the actors are the same.
- ``redis``: a writer's ``XADD`` + ``XLEN`` packet built by hand with the chunk encoded
  straight into it (``XaddPacker``). The plain path encodes the chunk to bytes and lets
  redis-py pack the two commands (``Connection.pack_commands``). Only the actors differ.

Each is measured on its whole path, as :mod:`bench_transport` runs it: 2 spawned actors
send chunks of 32 steps x 8 streams (70 KB) to one reader that writes them into a
``ReplayBuffer`` (``transport_ingest``); the variants alternate within every repetition.
``gain`` is the median rate of the fast path over the plain one, minus 1 (the issue keeps
a fast path that gains 15% or more); ``cpu_gain`` compares CPU per chunk (reader, actors,
redis-server) the same way, which other load on the machine moves less. One JSON line.

Usage::

    python benchmarks/transport/bench_fastpaths.py                  # both paths, 3 repetitions
    python benchmarks/transport/bench_fastpaths.py --paths ring --reps 5 --chunks 1000
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
import time
from typing import Any

import bench_transport
import common  # bench_transport put benchmarks/ on sys.path
import numpy as np
from bench_transport import (
    ACTORS,
    SPEC,
    RedisServer,
    actor_transport,
    make_buffer,
    make_chunks,
    read_transport,
    timed,
)

from shardreplay.transport import decode, encode, local, open_transport
from shardreplay.transport.codec import Encoding

PATHS = ("ring", "redis")
THRESHOLD = 0.15


class PlainRedisPackets:
    """The plain path for a redis writer: ``encode`` to bytes, redis-py packs the commands."""

    def __init__(self, writer: Any, stream: str, field: bytes) -> None:
        self._writer, self._key, self._field = writer, stream.encode("utf-8"), field

    def packet(self, enc: Encoding) -> bytes:
        data = bytearray(enc.nbytes)
        enc.write_into(np.frombuffer(data, np.uint8))
        return bytes(data)

    def push(self, data: bytes) -> None:
        conn = self._writer._connection()
        conn.send_packed_command(conn.pack_commands([(b"XADD", self._key, b"*", self._field, data),
                                                     (b"XLEN", self._key)]))


def actor_plain_redis(transport: Any, actor: int, n: int, ready: Any, go: Any, cpu_out: Any) -> None:
    """:func:`bench_transport.actor_transport` with the writer on the plain redis path."""
    from shardreplay.transport import redis as redis_transport

    make_writer = transport.writer

    def writer() -> Any:
        w = make_writer()
        plain = PlainRedisPackets(w, transport.stream, redis_transport._FIELD)
        w._packer, w._push = plain, plain.push
        return w

    transport.writer = writer
    actor_transport(transport, actor, n, ready, go, cpu_out)


def run_path(path: str, n: int, fast: bool, server: RedisServer | None) -> dict[str, float]:
    """One ingest run of ``path`` on its fast (``fast``) or plain path: :func:`timed`'s figures."""
    decode(encode(make_chunks(0)[0], SPEC), SPEC, max_bytes=1 << 30)  # compiled kernels loaded
    bench_transport.SERVER_PID = server.proc.pid if server is not None else 0
    if path == "ring":
        transport = open_transport("local", SPEC, capacity_bytes=64 << 20)
        actor = actor_transport
        local._ORDERED_STORES = fast and platform.machine().lower() in ("x86_64", "amd64")
    else:
        assert server is not None
        server.flush()
        transport = open_transport(server.url, SPEC)
        actor = actor_transport if fast else actor_plain_redis
    reader, buffer = transport.reader(), make_buffer()
    try:
        return timed(actor, lambda a: (transport, a, n),
                     lambda: read_transport(reader, ACTORS * n, buffer), ACTORS * n)
    finally:
        reader.close()
        local._ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")


def _cpu_us(case: dict[str, float]) -> float:
    return sum(v for k, v in case.items() if k.endswith("_cpu_us"))


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Medians per variant; ``gain`` (wall clock) and ``cpu_gain`` of fast over plain."""
    med = {v: {k: common.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
    gain = med["fast"]["steps_per_s"] / med["plain"]["steps_per_s"] - 1
    cpu_gain = _cpu_us(med["plain"]) / _cpu_us(med["fast"]) - 1
    return {"steps_per_s": {v: round(m["steps_per_s"]) for v, m in med.items()},
            "steps_per_s_each": {v: [round(r["steps_per_s"]) for r in rs] for v, rs in runs.items()},
            "cpu_us_per_chunk": {v: {k.removesuffix("_cpu_us"): round(x, 1) for k, x in m.items()
                                     if k.endswith("_cpu_us")} for v, m in med.items()},
            "gain": round(gain, 3), "cpu_gain": round(cpu_gain, 3), "keep": gain >= THRESHOLD}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__, reps=3, reps_help="repetitions of each variant (default 3)")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--chunks", type=int, default=600, help="chunks per actor (default 600)")
    args = p.parse_args(argv)
    args.paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if set(args.paths) - set(PATHS):
        p.error(f"--paths: choose from {PATHS}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_start = common.loadavg()
    results: dict[str, Any] = {}
    server = None
    try:
        if "redis" in args.paths:
            if shutil.which("redis-server") is None:
                results["redis"] = {"missing": "redis-server not installed"}
                args.paths.remove("redis")
            else:
                server = RedisServer()
        for path in args.paths:
            runs: dict[str, list[dict[str, float]]] = {"fast": [], "plain": []}
            for rep in range(args.reps):
                # Alternate which variant goes first, so a drift in load favours neither.
                order = ("fast", "plain") if rep % 2 == 0 else ("plain", "fast")
                for variant in order:
                    runs[variant].append(run_path(path, args.chunks, variant == "fast",
                                                  server if path == "redis" else None))
            results[path] = summarize(runs)
    finally:
        if server is not None:
            server.stop()
    common.emit_line({
        "bench": "fastpaths",
        "workload": {"actors": ACTORS, "chunk_bytes": len(encode(make_chunks(0)[0], SPEC)),
                     "chunks_per_actor": args.chunks, "reps": args.reps, "threshold": THRESHOLD},
        "results": results,
        "machine": {"python": common.python(), "cpus": common.cpus(),
                    "machine": platform.machine(), "loadavg_start": load_start,
                    "loadavg_end": common.loadavg(), "time": time.strftime("%H:%M")},
    }, args.out)


if __name__ == "__main__":
    sys.exit(main())
