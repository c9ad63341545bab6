"""The fast-path benchmark: the plain redis path sends the very bytes the hand-made packet
holds, its summary compares medians, and a tiny run prints one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.env import BENCHMARKS

BENCH = BENCHMARKS / "transport" / "bench_fastpaths.py"

import bench_fastpaths  # noqa: E402
import bench_transport  # noqa: E402

from shardreplay.transport.codec import Encoding  # noqa: E402


def test_summary_gain_is_fast_over_plain_medians() -> None:
    fast = [{"steps_per_s": r, "reader_cpu_us": 10.0, "actor_cpu_us": 30.0} for r in (90.0, 120.0, 130.0)]
    plain = [{"steps_per_s": r, "reader_cpu_us": 20.0, "actor_cpu_us": 30.0} for r in (100.0, 99.0, 101.0)]
    got = bench_fastpaths.summarize({"fast": fast, "plain": plain})
    assert got["steps_per_s"] == {"fast": 120, "plain": 100}
    assert got["gain"] == 0.2 and got["keep"] is True
    assert got["cpu_gain"] == 0.25  # 50 us a chunk plain, 40 fast
    slow = bench_fastpaths.summarize({"fast": plain, "plain": fast})
    assert slow["keep"] is False and slow["gain"] < 0


def test_plain_redis_packets_match_the_hand_made_ones() -> None:
    redis = pytest.importorskip("redis")
    from shardreplay.transport.redis import XaddPacker

    chunk = bench_transport.make_chunks(0)[0]
    hand = bytes(XaddPacker("shardreplay:chunks", b"d").packet(Encoding(chunk, bench_transport.SPEC)))
    conn = redis.Connection()  # never connects: only its packer is used
    plain = bench_fastpaths.PlainRedisPackets(None, "shardreplay:chunks", b"d")
    data = plain.packet(Encoding(chunk, bench_transport.SPEC))
    packed = conn.pack_commands([(b"XADD", b"shardreplay:chunks", b"*", b"d", data),
                                 (b"XLEN", b"shardreplay:chunks")])
    assert b"".join(bytes(p) for p in packed) == hand


@pytest.mark.slow
@pytest.mark.redis
def test_tiny_run_prints_one_json_line(tmp_path: Path) -> None:
    out = tmp_path / "fast.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--chunks", "10", "--reps", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text())
    assert set(line["results"]) == {"ring", "redis"}
    for result in line["results"].values():
        assert result["steps_per_s"]["fast"] > 0 and result["steps_per_s"]["plain"] > 0
        assert isinstance(result["keep"], bool)
