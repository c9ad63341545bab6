"""The one atomic write (``shardreplay._io.atomic_writer``) as its callers use it: a
temp directory of the caller's (the spool's ``tmp/``), no fsync where a caller turns
it off, nothing left behind on failure, and the temp names each reader skips."""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest

from shardreplay._io import atomic_write_bytes, storage_error
from shardreplay.policy.file_backend import FilePublisher
from shardreplay.spec import Field, Spec
from shardreplay.transport import open_transport
from shardreplay.transport.codec import Chunk


def test_a_temp_dir_and_no_fsync_still_replace_whole(tmp_path: Path) -> None:
    (tmp_path / "tmp").mkdir()
    atomic_write_bytes(tmp_path / "a", b"old")
    atomic_write_bytes(tmp_path / "a", memoryview(b"new"), fsync=False, tmp_dir=tmp_path / "tmp")
    assert (tmp_path / "a").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "tmp"]
    assert not any((tmp_path / "tmp").iterdir())


def test_a_refused_write_leaves_nothing_and_names_a_file(tmp_path: Path) -> None:
    with pytest.raises(OSError) as caught:
        atomic_write_bytes(tmp_path / "a", b"x", tmp_dir=tmp_path / "missing")
    assert caught.value.filename is not None and not (tmp_path / "a").exists()
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "a"))
    refused = storage_error(full)
    assert refused is not None and "cannot write" in str(refused) and "(ENOSPC)" in str(refused)


def test_a_new_publisher_removes_the_temps_a_dead_one_left(tmp_path: Path) -> None:
    """Temps of this helper (``.NAME.<hex>.tmp``) go; other files stay."""
    dead = [".policy-00000000000000000007.safetensors.0123456789ab.tmp", ".policy.version.abcdef012345.tmp"]
    for name in dead:
        (tmp_path / name).write_bytes(b"half")
    (tmp_path / "notes.tmp").write_bytes(b"not ours")
    FilePublisher(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp"]


def test_the_spool_writes_through_it_and_leaves_tmp_empty(tmp_path: Path) -> None:
    spec = Spec({"x": Field((), np.float32)})
    transport = open_transport(tmp_path.as_uri(), spec, fsync=False)
    steps = {"x": np.zeros((1, 2), np.float32), "step_type": np.zeros((1, 2), np.uint8),
             "discount": np.ones((1, 2), np.float32)}
    transport.writer().send(Chunk(actor_id=0, sequence=0, policy_version=0,
                                  stream_ids=np.zeros(1, np.int64), steps=steps))
    assert [p.name for p in (tmp_path / "ready").iterdir()] == ["0000000000-00000000000000000000.chunk"]
    assert list((tmp_path / "tmp").iterdir()) == []
    assert transport.backlog().chunks == 1
