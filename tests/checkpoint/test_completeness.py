"""Completeness includes every block's checksum, and every load names (in its report and
in one log line) the newer checkpoints it passed over and why. ``checkpoint verify``,
``train --resume`` and ``--auto-resume`` (which sets incomplete ones aside) use the same
rule."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardreplay import checkpoint
from shardreplay.cli.train import _check_resumable
from shardreplay.errors import CheckpointFormatError
from tests.checkpoint.helpers import as_shard, fill_random, make_buffer, step_multiset


def _save(root: Path, cid: int) -> dict[int, float]:
    """A checkpoint of two parts; returns its steps (ctr -> priority)."""
    steps: dict[int, float] = {}
    for k in range(2):
        local = make_buffer(2, 24, seed=k)
        fill_random(local, 20 + cid, shard=k, seed=10 * cid + k)
        checkpoint.save(as_shard(local, k, 2), root, cid, keep_last=None)
        steps.update(step_multiset(local))
    return steps


def _flip_a_bit(directory: Path) -> None:
    part = directory / "part-00001-of-00002.safetensors"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x10  # same size: only the block hash tells
    part.write_bytes(data)


def test_a_bit_flipped_newest_checkpoint_is_incomplete_and_passed_over(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    older = _save(tmp_path, 1)
    _save(tmp_path, 2)
    _save(tmp_path, 3)
    _flip_a_bit(checkpoint.checkpoint_dir(tmp_path, 3))
    (checkpoint.checkpoint_dir(tmp_path, 2) / "manifest.json").unlink()  # never completed

    assert not checkpoint.is_complete(checkpoint.checkpoint_dir(tmp_path, 3))
    assert checkpoint.latest_complete(tmp_path) == 1
    assert [c for c in checkpoint.list_checkpoints(tmp_path)
            if not checkpoint.is_complete(checkpoint.checkpoint_dir(tmp_path, c))] == [2, 3]
    for fallback in (False, True):
        buf = make_buffer(2, 48)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="shardreplay.checkpoint.load"):
            report = checkpoint.load(tmp_path, buf, fallback=fallback)
        assert report.checkpoint_id == 1 and step_multiset(buf) == older
        assert [s.split(":")[0] for s in report.skipped] == ["3", "2"]
        assert "checksum mismatch" in report.skipped[0] and "manifest.json: missing" in report.skipped[1]
        lines = [r.getMessage() for r in caplog.records if "passed over" in r.getMessage()]
        assert len(lines) == 1, lines
        assert "restored checkpoint 1" in lines[0] and "3: " in lines[0] and "2: " in lines[0]
        assert "checksum mismatch" in lines[0]


def test_a_clean_load_says_it_passed_over_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _save(tmp_path, 1)
    with caplog.at_level(logging.INFO, logger="shardreplay.checkpoint.load"):
        report = checkpoint.load(tmp_path, make_buffer(2, 48))
    assert report.skipped == []
    assert [r.getMessage() for r in caplog.records if "passed over" in r.getMessage()] == [
        f"checkpoint load from {tmp_path}: restored checkpoint 1; passed over none"]


def test_only_damaged_checkpoints_raise_naming_them(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    _flip_a_bit(checkpoint.checkpoint_dir(tmp_path, 1))
    buf = make_buffer(2, 48)
    fill_random(buf, 8)
    with pytest.raises(CheckpointFormatError, match=r"no usable checkpoint .*1: .*checksum mismatch"):
        checkpoint.load(tmp_path, buf)
    assert buf.num_steps == 0  # an error leaves the buffer empty, as documented


@pytest.mark.slow  # fresh interpreters or many examples: 20-100 s at load ~9 on 2 cores
def test_verify_resume_and_auto_resume_use_the_same_rule(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    _save(root, 1)
    _flip_a_bit(checkpoint.checkpoint_dir(root, 1))
    verify = subprocess.run([sys.executable, "-m", "shardreplay.cli.main", "checkpoint", "verify", str(root)],
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 1 and "checksum mismatch" in verify.stdout
    # train --resume refuses before anything starts, saying it is damaged (not incomplete).
    with pytest.raises(CheckpointFormatError, match=r"checkpoint 1 is damaged .*checksum mismatch in block"):
        _check_resumable(run_dir)
    moved, where = checkpoint.set_aside(root)  # what --auto-resume does first
    assert moved == [1] and where is not None and (where / "ckpt-0000000001").is_dir()
    assert checkpoint.list_checkpoints(root) == []


def test_a_file_changed_after_a_check_is_found_by_the_next(tmp_path: Path) -> None:
    """Every check reads what it checks: nothing verified earlier in the process is taken
    on trust (a part replaced with the same size and modification time is found too)."""
    _save(tmp_path, 1)
    directory = checkpoint.checkpoint_dir(tmp_path, 1)
    assert checkpoint.is_complete(directory)
    part = directory / "part-00001-of-00002.safetensors"
    before = part.stat()
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x10
    part.write_bytes(bytes(data))
    os.utime(part, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert not checkpoint.is_complete(directory)
    assert checkpoint.latest_complete(tmp_path) is None
