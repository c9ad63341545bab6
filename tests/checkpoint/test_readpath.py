"""The load's read path: contiguous episodes read as one range, block checks deferred
across many reads and still complete before a load succeeds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import checkpoint, testing
from shardreplay.checkpoint import format as ckfmt
from shardreplay.errors import CheckpointFormatError
from tests.checkpoint.helpers import fill_random, make_buffer, step_multiset

BIG = sr.Spec({"obs": sr.Field((1024,), np.float32), "ctr": sr.Field((), np.int64)})
ROWS, CAP = 2, 1024  # two streams of 4 MiB each: a ~8 MiB part of 9 blocks


def _big_checkpoint(root: Path) -> tuple[Path, sr.ReplayBuffer]:
    buf = sr.ReplayBuffer(BIG, num_streams=ROWS, stream_capacity=CAP)
    rng = np.random.default_rng(3)
    types = np.ones((ROWS, CAP + 100), np.uint8)
    types[:, ::37] = 0  # many episodes: a boundary inside most blocks
    ctr = np.arange(ROWS * (CAP + 100)).reshape(ROWS, -1)
    for lo, hi in ((0, CAP), (CAP, CAP + 100)):  # the rings wrap
        buf.extend({"obs": rng.random((ROWS, hi - lo, 1024), dtype=np.float32),
                    "ctr": ctr[:, lo:hi], "step_type": types[:, lo:hi]})
    return checkpoint.save(buf, root, 1), buf


def _stored(buf: sr.ReplayBuffer) -> dict[str, np.ndarray]:
    slots, _lengths = testing.shard(buf)._storage.stored_slots()
    return {name: arr[slots] for name, arr in testing.shard(buf).fields.items()}


@pytest.mark.parametrize("bad_block", [None, 2, 3, 8, "last"])
def test_deferred_checks_over_many_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        bad_block: int | str | None) -> None:
    """Reads of two blocks each (so a load issues many runs whose checks wait until the
    end): intact, the buffer holds exactly the saved steps; with one flipped byte in
    any block (the short last one included), the load fails naming that block and
    leaves the buffer empty."""
    monkeypatch.setattr(ckfmt, "_RUN_BYTES", 2 * ckfmt.BLOCK_BYTES)
    directory, saved = _big_checkpoint(tmp_path)
    part = directory / "part-00000-of-00001.safetensors"
    blocks = -(-part.stat().st_size // ckfmt.BLOCK_BYTES)
    assert blocks >= 9 and part.stat().st_size % ckfmt.BLOCK_BYTES
    restored = sr.ReplayBuffer(BIG, num_streams=ROWS, stream_capacity=CAP)
    if bad_block is None:
        checkpoint.load(tmp_path, restored)
        for name, arr in _stored(saved).items():
            np.testing.assert_array_equal(_stored(restored)[name], arr, err_msg=name)
        return
    block = blocks - 1 if bad_block == "last" else int(bad_block)
    data = bytearray(part.read_bytes())
    data[min(block * ckfmt.BLOCK_BYTES + 4321, len(data) - 1)] ^= 0x10
    part.write_bytes(data)
    with pytest.raises(CheckpointFormatError, match=f"{part.name}: checksum mismatch in block {block} "):
        checkpoint.load(tmp_path, restored)
    assert restored.num_steps == 0 and len(restored) == 0


def test_a_saved_stream_restored_whole_is_at_most_two_reads(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Same layout (a faithful resume): every row goes back to its ring slots, so each
    array is read with at most two calls per row (a wrapped ring's two pieces), not one
    per episode."""
    buf = make_buffer(3, 64)
    fill_random(buf, 150, seed=4)
    checkpoint.save(buf, tmp_path, 1)
    calls: list[tuple[str, int, int]] = []
    real = ckfmt.PartReader.rows_into

    def recording(self, name, start, out, **kwargs):
        if name.startswith("field."):
            calls.append((name, start, out.shape[0]))
        return real(self, name, start, out, **kwargs)

    monkeypatch.setattr(ckfmt.PartReader, "rows_into", recording)
    restored = make_buffer(3, 64)
    assert checkpoint.load(tmp_path, restored).exact
    assert step_multiset(restored) == step_multiset(buf)
    # (a field packed in the per-slot records goes through a temporary: a second, inner call)
    for n in buf.spec.fields:
        mine = sorted({c for c in calls if c[0] == f"field.{n}"})
        assert len(mine) <= 2 * buf.num_streams
        assert [c[1] for c in mine] == list(np.cumsum([0] + [c[2] for c in mine[:-1]]))
        assert sum(c[2] for c in mine) == buf.num_steps


def test_pending_checks_are_waited_for_on_close(tmp_path: Path) -> None:
    """A reader closed with deferred checks outstanding (an error elsewhere) waits for
    its hash thread and forgets them: nothing is left running."""
    directory, _saved = _big_checkpoint(tmp_path)
    part = checkpoint.load_manifest(directory).parts[0]
    with ckfmt.PartReader(directory / part.file, part) as reader:
        out = np.empty((CAP, 1024), np.float32)
        reader.rows_into("field.obs", 0, out, defer=True)
        assert reader._pending
    assert not reader._pending and reader._pool is None
