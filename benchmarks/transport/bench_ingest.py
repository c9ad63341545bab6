"""Ingest at Ape-X scale on one machine: many writers of Pong frames into one learner rank.

Each writer is a light process (numpy and shardreplay's transport, no torch, no emulator)
that replays a recorded Pong trajectory (``bench_wire_frames.record_pong``: 84x84
grayscale, frame skip 4, 4-frame stacks, recorded once into ``.bench/``) through the real
actor-side path: it builds chunks of ``--chunk-steps`` steps and sends them with the
transport's writer (``local``: encoded straight into the shared ring; ``file://`` and
Redis: packed, each new frame once, then LZ4, :mod:`shardreplay.transport.codec`; with
back-pressure). The learner (this process) receives, decodes and writes them into a
prioritized :class:`~shardreplay.ReplayBuffer` with a ``frame_stack`` field, one row per
writer, and between receives samples batches of ``--batch`` and updates their
priorities, as a learner does.

Reported per (transport, writers), as one JSON line at the end (and a line per case on
stderr): steps/s ingested, MB/s on the medium and as whole stacks, learner batches/s,
CPU microseconds per step of the learner, of the writers together and of redis-server
(the machine is shared: these say what a quiet machine would sustain, ``cpu_bound_steps_per_s``),
the learner's RSS sampled every second (start, end, max, slope over the second half), sent
vs stored chunks after the writers stop and the reader drains (``lost_chunks`` must be 0),
each writer's accepted steps/s (``fairness_max_over_min``) and the load average.

    python benchmarks/transport/bench_ingest.py --quick      # seconds: 8 writers, local, short trajectory
    python benchmarks/transport/bench_ingest.py              # 8, 32, 128 writers x local, file, redis
    python benchmarks/transport/bench_ingest.py --writers 32 --transports local --minutes 10   # RSS run
    python benchmarks/transport/bench_ingest.py --ab         # packing before/after, alternated, in-process

Needs the ``atari`` extra for the frames (``pip install -e .[atari]``) and ``redis-server``
on the PATH for ``redis``.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from shardreplay._signals import die_with_parent

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import common

HERE = Path(__file__).resolve().parent
FULL_FRAMES = 4000  # about 5 Pong points; a writer cycles through them from its own offset
QUICK_FRAMES = 600


def spec() -> Any:
    """The Nature-DQN replay spec: frame-stacked observations, action, reward."""
    from shardreplay.spec import Field, Spec

    return Spec({"obs": Field((4, 84, 84), np.uint8, frame_stack=True), "action": Field((), np.int64),
                 "reward": Field((), np.float32)})


def trajectory(frames: int) -> tuple[np.ndarray, np.ndarray]:
    """``frames`` recorded Pong stacks and their step types (recorded once, then read from .bench/)."""
    name = "pong_frames.npz" if frames == FULL_FRAMES else f"pong_frames_{frames}.npz"
    path = common.REPO / ".bench" / name
    if not path.exists():
        from bench_wire_frames import record_pong

        path.parent.mkdir(exist_ok=True)
        obs, types = record_pong(frames, seed=0)
        np.savez(path, obs=obs, step_type=types)
    data = np.load(path)
    return data["obs"], data["step_type"]


def steps_at(obs: np.ndarray, types: np.ndarray, at: int, t: int, first: bool) -> dict[str, np.ndarray]:
    """One stream's ``t`` steps from step ``at`` of the trajectory, as an actor builds them."""
    sl = slice(at, at + t)
    st = types[sl][None]
    if first:  # a writer's first step starts an episode
        st = st.copy()
        st[0, 0] = 0
    return {"obs": obs[sl][None], "action": np.zeros((1, t), np.int64),
            "reward": np.zeros((1, t), np.float32), "step_type": st, "discount": np.ones((1, t), np.float32)}


def writer_main(transport: Any, actor: int, obs: np.ndarray, types: np.ndarray, chunk_steps: int,
                go: Any, stop: Any, sent: Any, cpu: Any, nice: int, send_timeout_s: float) -> None:
    """Send chunks of the trajectory (from this writer's own offset) until ``stop``; count
    the chunks the medium took in ``sent[actor]`` and this process's CPU seconds in ``cpu``.
    As an actor does (``runtime/actor/loop.py``), a chunk is built once and sent again,
    the same object, after a ``TransportTimeout`` (each attempt waits ``send_timeout_s``)."""
    from shardreplay.errors import TransportTimeout
    from shardreplay.transport.codec import Chunk

    die_with_parent()  # a killed benchmark leaves no writer behind
    if nice:
        os.nice(nice)
    writer = transport.writer()
    n = len(obs) - chunk_steps
    at, seq = (actor * 997) % n, 0
    go.wait()
    c0 = time.process_time()
    chunk = None
    while not stop.is_set():
        if chunk is None:
            chunk = Chunk(actor, seq, 0, np.array([0]), steps_at(obs, types, at, chunk_steps, seq == 0))
        try:
            writer.send(chunk, timeout_s=send_timeout_s)
        except TransportTimeout:
            continue  # back-pressure: try the same chunk again (or stop)
        chunk = None
        seq += 1
        sent[actor] = seq
        # Back to the start (an episode's first step) before the trajectory runs out.
        at = at + chunk_steps if at + 2 * chunk_steps < n else 0
    with contextlib.suppress(Exception):
        if hasattr(writer, "flush"):
            writer.flush(timeout_s=30)  # Redis: every pipelined add confirmed
        writer.close()
    cpu[actor] = time.process_time() - c0


@contextlib.contextmanager
def medium(kind: str, scratch: Path, writers: int, chunk_bytes: int) -> Iterator[tuple[Any, Any]]:
    """The transport for one case, and the redis-server process for ``redis`` (else None)."""
    from shardreplay.transport import open_transport

    sp = spec()
    if kind == "local":
        yield open_transport("local", sp, capacity_bytes=max(64 << 20, 4 * writers * (chunk_bytes + 8))), None
        return
    if kind == "file":
        d = scratch / f"spool-{writers}"
        try:
            yield open_transport(d.absolute().as_uri(), sp, queued_chunks_per_actor=4, compression="lz4",
                                 fsync=False), None
        finally:
            shutil.rmtree(d, ignore_errors=True)
        return
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on the PATH: apt-get install -y redis-server")
    port = common.free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--dir", str(scratch)], stdout=subprocess.DEVNULL,
                            preexec_fn=die_with_parent)
    try:
        client = redis.Redis(port=port)
        for _ in range(200):
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    break
            time.sleep(0.05)
        client.close()
        yield open_transport(f"redis://127.0.0.1:{port}/0", sp, max_len=4 * writers, compression="lz4"), proc
    finally:
        proc.terminate()
        proc.wait(10)


class Ingest:
    """The learner: receive into the buffer, sample and update priorities, count."""

    def __init__(self, reader: Any, buffer: Any, writers: int, batch: int, ingest_ms: float) -> None:
        self.reader, self.buffer, self.batch, self.ingest_s = reader, buffer, batch, ingest_ms / 1000
        self.rng = np.random.default_rng(0)
        self.stored_chunks = 0
        self.rss: list[tuple[float, float]] = []
        self.reset(writers)

    def reset(self, writers: int) -> None:
        """Zero the timed counters."""
        self.steps = self.chunks = self.batches = 0
        self.ingest_cpu = self.sample_cpu = 0.0
        self.per_writer = np.zeros(writers, np.int64)

    def store(self, chunks: list[Any]) -> None:
        """Write received chunks into the buffer, then acknowledge them."""
        for c in chunks:
            self.buffer.extend(c.steps, stream_ids=np.array([c.actor_id]))
            self.per_writer[c.actor_id] += c.num_steps
            self.steps += c.num_steps
        self.reader.ack(chunks)
        self.chunks += len(chunks)
        self.stored_chunks += len(chunks)

    def run(self, deadline: float, rss_every_s: float = 1.0) -> None:
        """Receive for up to ``ingest_ms`` (or until nothing waits), then sample one batch
        and update its priorities; repeat until ``deadline``. RSS sampled every second."""
        next_rss = time.monotonic()
        while (now := time.monotonic()) < deadline:
            if now >= next_rss:
                self.rss.append((now, rss_mb()))
                next_rss = now + rss_every_s
            until = now + self.ingest_s
            c0 = time.process_time()
            while time.monotonic() < until:
                chunks = self.reader.receive(64, timeout_s=0.005, borrow=True)
                if not chunks:
                    break
                self.store(chunks)
            c1 = time.process_time()
            self.ingest_cpu += c1 - c0
            if len(self.buffer) >= self.batch:
                b = self.buffer.sample(self.batch)
                self.buffer.update_priorities(b.keys, self.rng.random(self.batch) + 0.01)
                self.batches += 1
                self.sample_cpu += time.process_time() - c1

    def drain(self, quiet_s: float = 1.0) -> int:
        """Store what is still in the medium after the writers stopped; how many chunks."""
        got = 0
        while chunks := self.reader.receive(64, timeout_s=quiet_s):
            self.store(chunks)
            got += len(chunks)
        return got


def rss_mb(pid: int | None = None) -> float:
    """Resident set size in MB (this process by default)."""
    import psutil

    return float(psutil.Process(pid).memory_info().rss / 2**20)


def cpu_s(proc: Any) -> float:
    """User + system CPU seconds of a child process (0 when there is none)."""
    if proc is None:
        return 0.0
    import psutil

    t = psutil.Process(proc.pid).cpu_times()
    return float(t.user + t.system)


def warm_kernels(sp: Any, obs: np.ndarray, types: np.ndarray, chunk_steps: int, batch: int) -> None:
    """Load (or compile) the learner's kernels before the clock and the writers start: the
    writers are forked from here and inherit them."""
    from shardreplay.buffer.replay_buffer import ReplayBuffer
    from shardreplay.transport.codec import Chunk, decode, encode

    buf = ReplayBuffer(sp, num_streams=2, stream_capacity=max(batch, 8 * chunk_steps), window=2,
                       sampler="prioritized", seed=0)
    for i in range(2 * batch // chunk_steps + 2):  # enough steps to sample a batch
        c = decode(encode(Chunk(i % 2, i // 2, 0, np.array([0]), steps_at(obs, types, 0, chunk_steps, True)),
                          sp), sp, max_bytes=1 << 30)
        buf.extend(c.steps, stream_ids=np.array([i % 2]))
        if len(buf) >= batch:
            b = buf.sample(batch)
            buf.update_priorities(b.keys, np.ones(batch))


def prefault(buffer: Any) -> None:
    """Touch the frame rings' pages now, as a buffer's first fill does, so the timed part
    measures the steady state of a long run (storage allocates lazily: during the first
    fill every frame written also faults its page in, which at this capacity would be
    most of a short case)."""
    for store in buffer._shard._storage.stacked.values():
        store.frames.fill(0)


def wire_bytes_per_step(kind: str, sp: Any, obs: np.ndarray, types: np.ndarray, chunk_steps: int) -> float:
    """Mean bytes on the medium per step over probe chunks of the trajectory (``local``:
    whole stacks; ``file``/``redis``: packed with LZ4, the record or entry overhead aside)."""
    from shardreplay.transport.codec import Chunk, encode, pack

    sizes = []
    for at in range(0, len(obs) - chunk_steps, max(chunk_steps, (len(obs) - chunk_steps) // 32)):
        data = encode(Chunk(0, 0, 0, np.array([0]), steps_at(obs, types, at, chunk_steps, at == 0)), sp)
        sizes.append(len(data) if kind == "local" else len(pack(data, sp, "lz4")))
    return float(np.mean(sizes)) / chunk_steps


def rss_summary(samples: list[tuple[float, float]]) -> dict[str, Any]:
    """Start, end, max and the slope (MB/min) over the second half of the RSS samples."""
    t = np.array([s[0] for s in samples]) - samples[0][0]
    r = np.array([s[1] for s in samples])
    half = t >= t[-1] / 2
    slope = float(np.polyfit(t[half], r[half], 1)[0] * 60) if half.sum() >= 3 else 0.0
    picks = np.unique(np.linspace(0, len(r) - 1, min(len(r), 11)).astype(int))
    return {"rss_mb_start": round(float(r[0])), "rss_mb_end": round(float(r[-1])),
            "rss_mb_max": round(float(r.max())),
            "rss_mb_per_min_second_half": round(slope, 2),
            "rss_mb_series": [[round(float(t[i])), round(float(r[i]))] for i in picks]}


def run_case(kind: str, writers: int, seconds: float, args: Any, scratch: Path, obs: np.ndarray,
             types: np.ndarray) -> dict[str, Any]:
    """One transport and number of writers: the figures of the module docstring."""
    from shardreplay.buffer.replay_buffer import ReplayBuffer
    from shardreplay.transport.codec import Chunk, encode

    sp, t_len = spec(), args.chunk_steps
    chunk_bytes = len(encode(Chunk(0, 0, 0, np.array([0]), steps_at(obs, types, 0, t_len, True)), sp))
    per_step = wire_bytes_per_step(kind, sp, obs, types, t_len)
    ctx = mp.get_context("fork")  # the writers share the trajectory's pages with this process
    load0 = common.loadavg()
    with medium(kind, scratch, writers, chunk_bytes) as (transport, server):
        go, stop = ctx.Event(), ctx.Event()
        sent, wcpu = ctx.Array("q", writers, lock=False), ctx.Array("d", writers, lock=False)
        procs = [ctx.Process(target=writer_main, args=(transport, a, obs, types, t_len, go, stop, sent, wcpu,
                                                               args.writer_nice, args.send_timeout),
                             daemon=True) for a in range(writers)]
        for p in procs:
            p.start()
        try:
            # The buffer after the fork: pages it writes are then not shared copy-on-write
            # with the writers (each would be copied at its first write, as a fault).
            rows = max(args.capacity // writers, 4 * t_len)
            buffer = ReplayBuffer(sp, num_streams=writers, stream_capacity=rows, window=2,
                                  sampler="prioritized", seed=0)
            if not args.no_prefault:
                prefault(buffer)
            reader = transport.reader()
            learner = Ingest(reader, buffer, writers, args.batch, args.ingest_ms)
            go.set()
            learner.run(time.monotonic() + min(5.0, max(1.0, seconds / 4)))  # fills the medium
            learner.reset(writers)
            learner.rss.clear()
            sent0 = int(sum(sent))
            s0, t0, c0 = cpu_s(server), time.monotonic(), time.process_time()
            learner.run(t0 + seconds)
            wall, cpu, srv = time.monotonic() - t0, time.process_time() - c0, cpu_s(server) - s0
            sent_timed = int(sum(sent)) - sent0
            learner.rss.append((time.monotonic(), rss_mb()))
            stop.set()
            left = learner.drain()  # the writers stop while this drains, never blocked
        finally:
            stop.set()
            go.set()  # writers still waiting to start see stop and end
            end = time.monotonic() + 60
            for p in procs:
                p.join(max(0.1, end - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join()
        left += learner.drain()
        reader.close()
    steps, per = learner.steps, learner.per_writer
    learner_us = learner.ingest_cpu / max(steps, 1) * 1e6  # receive, decode, extend, ack
    writers_us = float(sum(wcpu)) / max(int(sum(sent)) * t_len, 1) * 1e6
    server_us = srv / (sent_timed * t_len) * 1e6 if sent_timed else None  # None: no send ended in time
    return {"transport": kind, "writers": writers, "seconds": round(wall, 1),
            "load_avg": [load0, common.loadavg()],
            "steps_per_s": round(steps / wall),
            "wire_mb_per_s": round(steps * per_step / wall / 1e6, 1),
            "wire_bytes_per_step": round(per_step),
            "stack_mb_per_s": round(steps * chunk_bytes / t_len / wall / 1e6, 1),
            "learner_batches_per_s": round(learner.batches / wall, 1),
            "learner_sampled_per_s": round(learner.batches * args.batch / wall),
            "learner_cpu_share": round(cpu / wall, 2),
            "learner_ingest_cpu_us_per_step": round(learner_us, 1),
            "learner_sample_update_cpu_ms_per_batch": round(
                learner.sample_cpu / max(learner.batches, 1) * 1e3, 2),
            "writers_cpu_us_per_step": round(writers_us, 1),
            "server_cpu_us_per_step": None if server_us is None else round(server_us, 1),
            # What the machine's cores would sustain with nothing else running: all of
            # them divided by the CPU every step costs (learner's ingest + writers, their
            # waits for room included, + server); the learner's sampling comes on top.
            "cpu_bound_steps_per_s": None if server_us is None else round(
                (common.cpus() or 1) * 1e6 / max(learner_us + writers_us + server_us, 1e-9)),
            **rss_summary(learner.rss),
            "writer_steps_per_s_min_median_max": [round(float(x) / wall) for x in
                                                  (per.min(), np.median(per), per.max())],
            # None: a writer had no step accepted in the timed part (starved)
            "fairness_max_over_min": round(float(per.max() / per.min()), 2) if per.min() > 0 else None,
            "sent_chunks": int(sum(sent)), "stored_chunks": learner.stored_chunks, "drained_after_stop": left,
            "lost_chunks": int(sum(sent)) - learner.stored_chunks,
            "reader_stats": reader.stats.as_dict()}


# ------------------------------------------------------------------- before/after, alternated

def _legacy_stacks_back(body: np.ndarray, at: int, out: np.ndarray, arr: Any) -> int:
    """packing._stacks_back before this change: ``np.take`` in its default ``mode="raise"``,
    which copies through a temporary of ``out``."""
    from shardreplay.transport.codec import _take

    flags = _take(body, at, arr.steps)
    at += arr.steps
    added = np.where(flags == 1, 1, arr.stack)
    ends = np.cumsum(added)
    frames = int(ends[-1]) if arr.steps else 0
    src = _take(body, at, frames * arr.frame_bytes).reshape(frames, arr.frame_bytes)
    idx = (ends[:, None] - arr.stack + np.arange(arr.stack)).ravel()
    np.take(src, idx, axis=0, out=out.reshape(-1, arr.frame_bytes))
    return at + frames * arr.frame_bytes


def _legacy_packed(chunk: Any, sp: Any, codec: str) -> bytes:
    """PackedEncoding before this change: the plain encoding to new bytes, then packed."""
    from shardreplay.transport.codec import encode, pack

    return pack(encode(chunk, sp), sp, codec)


def _current_packed(chunk: Any, sp: Any, codec: str) -> bytes:
    from shardreplay.transport.codec import PackedEncoding

    enc = PackedEncoding(chunk, sp, codec)
    out = bytearray(enc.nbytes)
    enc.write_into(out)
    return bytes(out)


def ab_packing(obs: np.ndarray, types: np.ndarray, chunk_steps: int, rounds: int) -> dict[str, Any]:
    """CPU microseconds per step for an actor to pack a Pong chunk (LZ4) and for the
    learner to decode it, with the code before and after this change, alternated round
    by round in this process (so both see the same machine load); medians over rounds."""
    from shardreplay.transport import codec as packing
    from shardreplay.transport.codec import Chunk, decode

    sp = spec()
    n = len(obs) - chunk_steps
    chunks = [Chunk(0, i, 0, np.array([0]), steps_at(obs, types, (i * 997) % n, chunk_steps, True))
              for i in range(48)]
    current = packing._stacks_back
    variants: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
        "before": (_legacy_packed, _legacy_stacks_back), "after": (_current_packed, current)}
    got: dict[str, dict[str, list[float]]] = {v: {"pack": [], "decode": []} for v in variants}
    steps = len(chunks) * chunk_steps
    try:
        for r in range(rounds):
            for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
                packer, packing._stacks_back = variants[name]
                with common.timed() as tp:
                    packed = [packer(c, sp, "lz4") for c in chunks]
                with common.timed() as td:
                    back = [decode(p, sp, max_bytes=1 << 30) for p in packed]
                if not all(np.array_equal(b.steps["obs"], c.steps["obs"])
                           for b, c in zip(back, chunks, strict=True)):
                    raise AssertionError(f"{name}: decoded frames differ from the sent ones")
                got[name]["pack"].append(tp.cpu_s / steps * 1e6)
                got[name]["decode"].append(td.cpu_s / steps * 1e6)
    finally:
        packing._stacks_back = current
    return {f"{what}_cpu_us_per_step_{name}": common.median(got[name][what], 1)
            for name in variants for what in ("pack", "decode")} | {"rounds": rounds}


_COLUMNS = ("transport", "writers", "steps/s", "MB/s on the medium", "MB/s as stacks",
            "learner batches/s (x512)", "learner ingest CPU us/step", "writers CPU us/step",
            "redis-server CPU us/step", "CPU-bound steps/s",
            "RSS MB start/end/max", "sent = stored, lost", "writer steps/s min/median/max", "max/min",
            "load avg at start")


def table(line: dict[str, Any]) -> str:
    """The markdown table of one run's JSON line (RESULTS-ingest.md)."""
    rows = ["| " + " | ".join(_COLUMNS) + " |", "|" + " --- |" * len(_COLUMNS)]
    for c in line["cases"]:
        cells = [c["transport"], c["writers"], f"{c['steps_per_s']:,}", c["wire_mb_per_s"],
                 c["stack_mb_per_s"], c["learner_batches_per_s"], c["learner_ingest_cpu_us_per_step"],
                 c["writers_cpu_us_per_step"],
                 c["server_cpu_us_per_step"] if c["transport"] == "redis" else "-",
                 f"{c['cpu_bound_steps_per_s']:,}" if c["cpu_bound_steps_per_s"] is not None else "-",
                 f"{c['rss_mb_start']}/{c['rss_mb_end']}/{c['rss_mb_max']}",
                 f"{c['sent_chunks']:,} = {c['stored_chunks']:,}, {c['lost_chunks']}",
                 "/".join(str(x) for x in c["writer_steps_per_s_min_median_max"]),
                 c["fairness_max_over_min"], c["load_avg"][0][0]]
        rows.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(__doc__, quick="8 writers, local, 3 s, a 600-step trajectory")
    ap.add_argument("--writers", default="8,32,128", help="comma-separated writer counts (default 8,32,128)")
    ap.add_argument("--transports", default="local,file,redis", help="default local,file,redis")
    ap.add_argument("--seconds", type=float, default=20.0, help="timed seconds per case (default 20)")
    ap.add_argument("--minutes", type=float, help="timed minutes per case instead (the RSS run: 10)")
    ap.add_argument("--chunk-steps", type=int, default=32, help="steps per chunk (default 32)")
    ap.add_argument("--batch", type=int, default=512, help="learner batch size (default 512)")
    ap.add_argument("--capacity", type=int, default=200_000, help="replay steps in all (default 200,000)")
    ap.add_argument("--ingest-ms", type=float, default=20.0,
                    help="the learner receives for up to this long between two sampled batches (default 20)")
    ap.add_argument("--writer-nice", type=int, default=10,
                    help="writers' nice value (default 10): the learner under test is not outcompeted by "
                         "its own writers; 0 shares the cores equally with every writer")
    ap.add_argument("--send-timeout", type=float, default=5.0,
                    help="seconds a writer's send waits for room before it tries again (default 5.0, "
                         "the actors' send_timeout_s; runs before 2026-11-27 12:00 used 0.2)")
    ap.add_argument("--table", type=Path, help="print the markdown table of a saved JSON line, run nothing")
    ap.add_argument("--no-prefault", action="store_true",
                    help="leave the frame rings' pages to the first fill (timed part then includes it)")
    ap.add_argument("--ab", action="store_true", help="only the packing before/after comparison, alternated")
    ap.add_argument("--ab-rounds", type=int, default=10, help="rounds of --ab (default 10)")
    args = ap.parse_args(argv)
    if args.table is not None:
        print(table(json.loads(args.table.read_text().strip().splitlines()[-1])))
        return
    if args.minutes is not None:
        args.seconds = args.minutes * 60
    frames = FULL_FRAMES
    if args.quick:
        args.writers, args.transports, args.seconds, args.capacity = "8", "local", 3.0, 20_000
        frames = QUICK_FRAMES
    obs, types = trajectory(frames)
    head = {"bench": "ingest", "frames": f"ALE/Pong-v5 84x84x4 uint8, {len(obs)} recorded steps",
            "chunk_steps": args.chunk_steps, "batch": args.batch, "cores": common.cpus(),
            "python": common.python(),
            "commit": common.commit(), "date": common.now()}
    if args.ab:
        load0 = common.loadavg()
        ab = ab_packing(obs, types, args.chunk_steps, args.ab_rounds)
        common.emit_line(head | {"ab": "packing", "load_avg": [load0, common.loadavg()]} | ab, args.out)
        return
    warm_kernels(spec(), obs, types, args.chunk_steps, args.batch)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as scratch:
        for kind in args.transports.split(","):
            for writers in (int(w) for w in args.writers.split(",")):
                case = run_case(kind, writers, args.seconds, args, Path(scratch), obs, types)
                print(json.dumps(case), file=sys.stderr, flush=True)
                results.append(case)
    common.emit_line(head | {"writer_nice": args.writer_nice, "send_timeout_s": args.send_timeout,
                             "load_avg": common.loadavg(), "cases": results},
                     args.out)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
