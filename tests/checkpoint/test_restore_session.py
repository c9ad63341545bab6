"""The restore session (the one way into a shard's content), the manifest covering every
file of a checkpoint, and the verification rule: a load reads the manifest once and
hashes each block it reads once, and no step block of a part it does not restore.

About 13 s in all on 2 busy cores (two-part checkpoints of 3 blocks each).
"""

from __future__ import annotations

import collections
import shutil
from pathlib import Path

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import checkpoint, testing
from shardreplay.buffer.shard import Shard
from shardreplay.checkpoint import format as ckfmt
from shardreplay.checkpoint.loading import load_shard
from shardreplay.checkpoint.manifest import dump_checked, incomplete_reason, load_checked
from shardreplay.errors import CheckpointError, CheckpointFormatError
from tests.checkpoint.helpers import as_shard

SPEC = sr.Spec({"obs": sr.Field((256,), np.float32)})
ROWS, CAP = 2, 1024  # 2 MiB of obs per part: 3 blocks
LEARNER = b"agent weights \x00\x01" * 1000


def _buffer(seed: int = 0) -> sr.ReplayBuffer:
    return sr.ReplayBuffer(SPEC, num_streams=ROWS, stream_capacity=CAP, window=1, sampler="prioritized",
                           seed=seed)


def _fill(buf: sr.ReplayBuffer, part: int) -> None:
    """Every step distinct (no two blocks of any part alike: a block's hash names it)."""
    t = np.arange(CAP)
    types = np.where(t % 100 == 0, 0, np.where(t % 100 == 99, 2, 1)).astype(np.uint8)
    obs = (t[None, :, None] + 10_000 * np.arange(ROWS)[:, None, None] + 100_000 * part
           + np.zeros((1, 1, 256))).astype(np.float32)
    buf.extend({"obs": obs, "step_type": np.broadcast_to(types, (ROWS, CAP)),
                "discount": np.ones((ROWS, CAP), np.float32)})


def _save(root: Path, files: dict[str, bytes] | None = None) -> Path:
    """Checkpoint 1 of two parts; rank 0 saves ``files`` too."""
    for k in range(2):
        buf = _buffer(k)
        _fill(buf, k)
        checkpoint.save(as_shard(buf, k, 2), root, 1, files=files if k == 0 else None)
    return checkpoint.checkpoint_dir(root, 1)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.slow  # about 11 s on 2 busy cores: five copies, each checked and loaded
def test_the_manifest_covers_every_file_and_names_the_damaged_one(tmp_path: Path) -> None:
    directory = _save(tmp_path / "good", {"learner_state.pt": LEARNER})
    manifest = checkpoint.load_manifest(directory)
    others = {p.name for p in directory.iterdir()} - {"manifest.json"} - {p.file for p in manifest.parts}
    assert set(manifest.files) == others == {"learner_state.pt", "part-00000-of-00002.json",
                                             "part-00001-of-00002.json"}
    assert manifest.files["learner_state.pt"].bytes == len(LEARNER)
    report = checkpoint.load(tmp_path / "good", _buffer(), files=("learner_state.pt",))
    assert report.files == {"learner_state.pt": LEARNER} and report.manifest == manifest

    for path in sorted(directory.iterdir()):  # damage each file in turn, in a copy
        root = tmp_path / f"bad-{path.name}"
        shutil.copytree(tmp_path / "good", root)
        bad = checkpoint.checkpoint_dir(root, 1) / path.name
        _flip(bad, bad.stat().st_size // 2)
        reason = incomplete_reason(bad.parent, missing=False)
        assert reason is not None and path.name in reason, (path.name, reason)
        with pytest.raises(CheckpointError, match=path.name.replace(".", r"\.")):
            checkpoint.load(root, _buffer(), files=("learner_state.pt",))


def test_a_manifest_without_the_files_table_is_refused(tmp_path: Path) -> None:
    """Written before f00eda4 (which wrote the table): malformed now, never read unchecked."""
    directory = _save(tmp_path, {"learner_state.pt": LEARNER})
    body = load_checked(directory / "manifest.json")
    del body["files"]
    dump_checked(directory / "manifest.json", body)
    assert "malformed manifest" in (incomplete_reason(directory, missing=False) or "")
    with pytest.raises(CheckpointFormatError, match="malformed manifest"):
        checkpoint.load(tmp_path, _buffer(), files=("learner_state.pt",))


def _count_reads(monkeypatch: pytest.MonkeyPatch, directory: Path
                 ) -> tuple[collections.Counter[tuple[str, int]], collections.Counter[str]]:
    """Count, per (part file, block), the hashes computed, and per file name the reads."""
    manifest = checkpoint.load_manifest(directory)
    block_of = {int(h, 16): (p.file, b) for p in manifest.parts for b, h in enumerate(p.block_xxh64)}
    assert len(block_of) == sum(len(p.block_xxh64) for p in manifest.parts)  # blocks all differ
    hashed: collections.Counter[tuple[str, int]] = collections.Counter()
    reads: collections.Counter[str] = collections.Counter()
    real_hash, real_read = ckfmt.xxh64, Path.read_bytes

    def counting_hash(data: memoryview, seed: int = 0) -> int:
        digest = real_hash(data, seed)
        hashed[block_of.get(digest, ("?", -1))] += 1
        return digest

    def counting_read(self: Path) -> bytes:
        reads[self.name] += 1
        return real_read(self)

    monkeypatch.setattr(ckfmt, "xxh64", counting_hash)
    monkeypatch.setattr(Path, "read_bytes", counting_read)
    return hashed, reads


def test_a_load_reads_the_manifest_once_and_hashes_each_block_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = _save(tmp_path)
    hashed, reads = _count_reads(monkeypatch, directory)
    report = checkpoint.load(tmp_path, _buffer())  # 2 parts -> 1 shard: reads both
    assert report.steps + report.dropped_steps == 2 * ROWS * CAP and not report.exact
    assert reads["manifest.json"] == 1
    assert ("?", -1) not in hashed
    assert max(hashed.values()) == 1, hashed  # no block hashed twice
    assert {f for f, _b in hashed} == {"part-00000-of-00002.safetensors", "part-00001-of-00002.safetensors"}


def test_a_rank_hashes_no_step_block_of_a_part_it_does_not_restore(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = _save(tmp_path)
    hashed, reads = _count_reads(monkeypatch, directory)
    report = load_shard(directory, _buffer(), 0, 2)  # rank 0 of 2, as saved: its own part only
    assert report.exact and reads["manifest.json"] == 1
    # Its own part whole; of the other only block 0 (header and episode tables: every
    # rank plans with all of them), none of its steps.
    assert set(hashed) == {("part-00000-of-00002.safetensors", b) for b in range(3)} | \
        {("part-00001-of-00002.safetensors", 0)}
    assert max(hashed.values()) == 1, hashed


def test_the_restore_session_enforces_its_order_and_guards_saving(tmp_path: Path) -> None:
    for name in ("begin_restore", "finish_restore", "restore_keys", "restored_sampler_state", "targets",
                 "frame_stores", "clear"):
        assert not hasattr(Shard, name), name  # one way in: Shard.restore()
    buf = _buffer()
    _fill(buf, 0)
    shard = testing.shard(buf)
    with pytest.raises(ValueError, match="boom"), shard.restore("somewhere") as session:
        session.targets()["field.obs"][:5] = 1.0
        raise ValueError("boom")
    assert buf.num_steps == 0 and shard.pending_restore == "somewhere"  # empty, and clearly so:
    with pytest.raises(CheckpointError, match="somewhere"):
        checkpoint.save(buf, tmp_path, 1)  # save refuses it
    with pytest.raises(CheckpointError, match="before finish"), shard.restore("again"):
        pass
    assert shard.pending_restore == "again"
    with shard.restore("done") as session:
        session.finish(np.zeros(ROWS, np.int64), 0, sampler_state={"max_priority": 2.0, "draws": 3},
                       rng_state=None, stale_updates=0, key_epoch=7, key_tag=None)
        with pytest.raises(CheckpointError, match="not allowed"):
            session.targets()  # placing after finish
        with pytest.raises(CheckpointError, match="not allowed"):
            session.finish(np.zeros(ROWS, np.int64), 0, sampler_state={}, rng_state=None,
                           stale_updates=0, key_epoch=7, key_tag=None)
    assert shard.pending_restore is None and shard.key_epoch == 7 and buf.info().max_priority == 2.0
    with pytest.raises(CheckpointError, match="not allowed"):
        session.targets()  # after the block
    checkpoint.save(buf, tmp_path, 1)
