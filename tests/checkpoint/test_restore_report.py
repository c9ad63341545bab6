"""Every save and every restore says what it dropped and sealed, per shard, in the
manifest and in one log line; a restore accounts for every saved step.

A 2-shard checkpoint is restored onto 3 shards whose rows are too short for it (so the
restore must drop episodes and cut the head of others), then saved again with the
restore's counts: the new manifest records them, per part and summed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from shardreplay import checkpoint, testing
from shardreplay.checkpoint.loading import load_shard
from shardreplay.checkpoint.summary import summarize
from shardreplay.errors import CheckpointError
from tests.checkpoint.helpers import as_shard, fill_random, make_buffer

STREAMS = 3


def _source(root: Path) -> dict:
    for k in range(2):
        local = make_buffer(STREAMS, 60, seed=k)
        # Long episodes (p_end small) so rows of 12 steps must cut some of them.
        fill_random(local, 90, shard=k, seed=7 + k, p_end=0.04, p_abandon=0.0)
        checkpoint.save(as_shard(local, k, 2), root, 1, keep_last=None)
    return checkpoint.load_manifest(checkpoint.checkpoint_dir(root, 1))


def test_restore_reports_drops_and_seals_and_the_next_save_records_them(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    saved = _source(tmp_path)
    reports, shards = [], []
    with caplog.at_level(logging.INFO, logger="shardreplay.checkpoint"):
        for n in range(3):
            local = make_buffer(STREAMS, 12, seed=50 + n)
            reports.append(load_shard(checkpoint.checkpoint_dir(tmp_path, 1), local, n, 3))
            shards.append(local)
    lines = [r.getMessage() for r in caplog.records if "restored" in r.getMessage()]
    assert len(lines) == 3, lines  # one line per shard
    for n, (line, rep) in enumerate(zip(lines, reports, strict=True)):
        assert f"shard {n}/3 restored {rep.steps} steps" in line
        assert f"dropped its {rep.dropped_episodes} oldest episodes ({rep.dropped_steps} steps)" in line
        assert f"sealed {rep.sealed_episodes} episodes ({rep.sealed_steps} steps kept)" in line
    # Every saved step is restored or counted as dropped; this layout must lose some.
    assert sum(r.steps + r.dropped_steps for r in reports) == saved.steps
    assert all(r.saved_steps == saved.steps for r in reports)
    assert sum(r.dropped_episodes for r in reports) > 0 and sum(r.sealed_episodes for r in reports) > 0
    for rep, local in zip(reports, shards, strict=True):
        assert len(testing.shard(local)._storage.stored_slots()[0]) == rep.steps

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardreplay.checkpoint"):
        for n, local in enumerate(shards):
            # The shard remembers what it was restored from: every save records it.
            checkpoint.save(as_shard(local, n, 3), tmp_path, 2, keep_last=None)
    manifest = checkpoint.load_manifest(checkpoint.checkpoint_dir(tmp_path, 2))
    for n, rep in enumerate(reports):
        assert manifest.parts[n].restored == rep.counts()
    total = manifest.restored
    assert total is not None and total.checkpoint_id == 1 and total.saved_shards == 2
    assert total.saved_steps == saved.steps == total.steps + total.dropped_steps
    assert total.steps == manifest.steps
    assert total.dropped_episodes == sum(r.dropped_episodes for r in reports)
    assert total.sealed_steps == sum(r.sealed_steps for r in reports)
    complete = [r.getMessage() for r in caplog.records if "complete:" in r.getMessage()]
    assert len(complete) == 1
    assert (f"dropped {total.dropped_episodes} episodes ({total.dropped_steps} steps), "
            f"sealed {total.sealed_episodes} episodes ({total.sealed_steps} steps)") in complete[0]
    # The partial-episode policy of the save itself is in the same line, with steps.
    part = manifest.partial
    assert f"sealed {part['sealed_episodes']} ({part['sealed_steps']} steps)" in complete[0]
    summary = summarize(checkpoint.checkpoint_dir(tmp_path, 2), priorities=False)
    assert summary["restored"] == total.as_dict()
    assert [row["restored"] for row in summary["parts"]] == [r.counts().as_dict() for r in reports]


def test_a_lossless_restore_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    saved = _source(tmp_path)
    with caplog.at_level(logging.INFO, logger="shardreplay.checkpoint"):
        reports = [load_shard(checkpoint.checkpoint_dir(tmp_path, 1), make_buffer(STREAMS, 60), n, 3)
                   for n in range(3)]
    assert sum(r.steps for r in reports) == saved.steps
    lines = [r.getMessage() for r in caplog.records if "restored" in r.getMessage()]
    assert len(lines) == 3 and all("dropped its 0 oldest episodes (0 steps)" in line for line in lines), lines


def test_content_replaced_after_a_load_records_no_restore(tmp_path: Path) -> None:
    """The restore a save records is the one its content came from: content replaced
    since (``load_state_dict``) came from elsewhere."""
    _source(tmp_path)
    local = make_buffer(STREAMS, 60, seed=3)
    report = checkpoint.load(tmp_path, local)
    checkpoint.save(local, tmp_path, 2, keep_last=None)
    assert checkpoint.load_manifest(checkpoint.checkpoint_dir(tmp_path, 2)).restored == report.counts()
    other = make_buffer(STREAMS, 60, seed=4)
    fill_random(other, 10)
    local.load_state_dict(other.state_dict())
    checkpoint.save(local, tmp_path, 3, keep_last=None)
    assert checkpoint.load_manifest(checkpoint.checkpoint_dir(tmp_path, 3)).restored is None


def test_a_buffer_a_failed_load_emptied_is_never_saved_as_a_complete_checkpoint(tmp_path: Path) -> None:
    """A crash handler that saves after a failed restore must not write a complete, empty
    checkpoint newer than the one that failed to load (it would be resumed from next)."""
    good = make_buffer(STREAMS, 40, seed=1)
    fill_random(good, 30, seed=3)
    directory = checkpoint.save(good, tmp_path, 1, keep_last=None)
    part = directory / "part-00000-of-00001.safetensors"
    part.write_bytes(part.read_bytes()[:-8])  # truncated: this checkpoint cannot be loaded

    buf = make_buffer(STREAMS, 40, seed=2)
    fill_random(buf, 20, seed=4)
    with pytest.raises(CheckpointError):
        checkpoint.load(tmp_path, buf, checkpoint_id=1)
    assert len(testing.shard(buf)._storage.stored_slots()[0]) == 0  # the load emptied it, as documented
    with pytest.raises(CheckpointError, match="does not hold what its run restored"):
        checkpoint.save(buf, tmp_path, 2, keep_last=None)
    assert checkpoint.latest_complete(tmp_path) is None
    assert not checkpoint.is_complete(checkpoint.checkpoint_dir(tmp_path, 2))

    checkpoint.save(good, tmp_path, 3, keep_last=None)  # a good one appears; loading it clears the mark
    report = checkpoint.load(tmp_path, buf, checkpoint_id=3)
    checkpoint.save(buf, tmp_path, 4, keep_last=None)
    manifest = checkpoint.load_manifest(checkpoint.checkpoint_dir(tmp_path, 4))
    assert manifest.steps == report.steps > 0 and manifest.restored == report.counts()
