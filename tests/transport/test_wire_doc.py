"""docs/transports.md is the wire format's specification: the byte offsets it prints for a
chunk (``SRCK``), a packed chunk (``SRCZ``) and an ingest log record (``SRWL``) are read back
from real encoded bytes here, so the document cannot drift from the code."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import msgpack

from shardreplay._hashing import xxh3_64, xxh64
from shardreplay.runtime.learner.wal import IngestLog
from shardreplay.transport import codec
from shardreplay.transport.codec import encode, pack
from tests.transport.transport_helpers import SPEC, make_chunk

DOC = Path(__file__).resolve().parents[2] / "docs" / "transports.md"
ROW = re.compile(r"^\s*(?:offset )?(\d+|P)\s{2,}(.+?)\s*$")


class _Layout:
    """The first ``text`` block under ``## section``: its rows' offsets, by what they say."""

    def __init__(self, section: str) -> None:
        body = DOC.read_text().split(f"## {section}\n", 1)[1]
        block = body.split("```text\n", 1)[1].split("```", 1)[0]
        rows = [ROW.match(line) for line in block.splitlines()]
        self.rows = [(m.group(2), int(m.group(1))) for m in rows if m and m.group(1) != "P"]

    def __getitem__(self, says: str) -> int:
        (offset,) = [at for text, at in self.rows if text.startswith(says)]
        return offset


def test_the_documented_chunk_layout_is_the_encoded_one() -> None:
    doc = _Layout("Chunks")
    chunk = make_chunk(actor_id=7, sequence=11, s=2, t=3, priorities=True)
    data = encode(chunk, SPEC)
    u32 = lambda at: struct.unpack_from("<I", data, at)[0]  # noqa: E731
    u64 = lambda at: struct.unpack_from("<Q", data, at)[0]  # noqa: E731
    assert data[doc["magic  b\"SRCK\""]:][:4] == b"SRCK"
    assert data[doc["format version"]] == codec.FORMAT_VERSION == 3
    assert data[doc["format version"] + 1:][:3] == bytes(3)
    header_len = u32(doc["header_len"])
    assert u64(doc["total_len"]) == len(data)
    assert data[doc["4 zero bytes"]:][:4] == bytes(4)
    assert u64(doc["XXH3-64"]) == xxh3_64(memoryview(data)[32:])  # "every byte after offset 32"
    ids = doc["actor id, sequence, policy version"]
    assert struct.unpack_from("<3Q", data, ids) == (7, 11, chunk.policy_version)
    at = doc["msgpack header, zero padding to a multiple of 8"]
    header = msgpack.unpackb(data[at:at + header_len])
    assert set(header) == {"fp", "S", "T", "arrays"}
    assert [entry[0] for entry in header["arrays"]][:1] == ["stream_ids"]
    assert header["arrays"][-1][0] == "priorities"
    payload = -(-(at + header_len) // 8) * 8
    assert data[at + header_len:payload] == bytes(payload - at - header_len)
    assert len(data) % 8 == 0


def test_the_documented_packed_layout_is_the_packed_one() -> None:
    doc = _Layout("Packed chunks")
    data = encode(make_chunk(actor_id=1, sequence=2), SPEC)
    packed = pack(data, SPEC, "lz4")
    u64 = lambda at: struct.unpack_from("<Q", packed, at)[0]  # noqa: E731
    assert packed[doc["magic b\"SRCZ\""]:][:4] == b"SRCZ"
    version_at = doc["packing version"]
    assert packed[version_at] == codec.PACKING_VERSION
    assert packed[version_at + 1] == codec.CODECS.index("lz4") == 1
    assert u64(doc["total_len"]) == len(packed)
    assert u64(doc["chunk_len"]) == len(data)
    assert u64(doc["XXH3-64 of every byte after offset 40"]) == xxh3_64(memoryview(packed)[40:])
    assert doc["the body, compressed by the codec"] == 40


def test_the_documented_ingest_log_record_is_the_written_one(tmp_path: Path) -> None:
    doc = _Layout("Ingest log records")
    data = encode(make_chunk(actor_id=5, sequence=9), SPEC)
    log = IngestLog(tmp_path, 1, 3, fsync=False)
    log.append([(memoryview(data), 5, 9, 4, 12), (None, 6, 1, -1, 8)])
    log.close()
    (path,) = tmp_path.glob("*.wal")
    raw = path.read_bytes()
    i64 = lambda at: struct.unpack_from("<q", raw, at)[0]  # noqa: E731
    start = doc["magic b\"SRWL\""]
    assert raw[start:start + 4] == b"SRWL" and raw[start + 6:start + 8] == bytes(2)
    assert raw[start + 5] == 0  # flags: the chunk bytes are kept
    assert struct.unpack_from("<II", raw, doc["shard, world"]) == (1, 3)
    assert struct.unpack_from("<Q", raw, doc["length of the chunk bytes"])[0] == len(data)
    assert struct.unpack_from("<qq", raw, doc["actor id, sequence"]) == (5, 9)
    assert i64(doc["previous sequence"]) == 4
    assert i64(doc["steps in the chunk"]) == 12
    assert abs(i64(doc["insert time"]) / 1e9 - path.stat().st_mtime) < 600
    assert struct.unpack_from("<Q", raw, doc["XXH3-64 of the chunk bytes"])[0] == xxh3_64(data)
    head = doc["XXH64 of bytes 0..71"]
    assert struct.unpack_from("<Q", raw, head)[0] == xxh64(raw[:head])
    body = doc["the chunk bytes"]
    assert raw[body:body + len(data)] == data
    second = raw[body + len(data):]  # a header-only record: flags bit 0, no bytes after it
    assert len(second) == body and second[5] & 1 == 1
    assert struct.unpack_from("<Q", second, doc["length of the chunk bytes"])[0] == 0
