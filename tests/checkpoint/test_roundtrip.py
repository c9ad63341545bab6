"""Save/load round trips: same distribution, counters and RNG; only stored steps on disk."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import checkpoint, testing
from shardreplay.checkpoint.manifest import checkpoint_dir
from shardreplay.errors import ConfigError
from tests.checkpoint.helpers import (
    SPEC,
    assert_same_distribution,
    fill_random,
    make_buffer,
    step_multiset,
    stored_steps,
    union_distribution,
    window_table,
)


@pytest.mark.parametrize("sampler", ["prioritized", "uniform"])
def test_round_trip_keeps_distribution_priorities_and_counters(tmp_path: Path, sampler: str) -> None:
    buf = make_buffer(3, 40, sampler=sampler, seed=1)
    fill_random(buf, 70, seed=1)
    buf.sample(8)  # moves the beta schedule and the RNG
    before = union_distribution([window_table(buf)])
    steps_before = step_multiset(buf)

    checkpoint.save(buf, tmp_path, 7, files={"step.json": b'{"step": 70}'})
    restored = make_buffer(3, 40, sampler=sampler, seed=99)
    report = checkpoint.load(tmp_path, restored, files=("step.json",))

    assert report.checkpoint_id == 7 and json.loads(report.files["step.json"]) == {"step": 70}
    assert report.steps == buf.num_steps == restored.num_steps
    assert step_multiset(restored) == steps_before
    assert_same_distribution(before, union_distribution([window_table(restored)]))
    assert len(restored) == len(buf)
    # One shard onto one shard: the sampling RNG continues where it was.
    assert testing.rng_state(restored) == testing.rng_state(buf)
    if sampler == "prioritized":
        for name in ("max_priority", "draws"):
            assert testing.sampler_counters(restored)[name] == testing.sampler_counters(buf)[name]
    # The restored buffer keeps working: sample, update, write.
    batch = restored.sample(32)
    if sampler == "prioritized":
        assert restored.update_priorities(batch.keys, np.full(32, 0.5, np.float32)) == 32
    fill_random(restored, 5, seed=3, update_rounds=0)


def test_empty_buffer_round_trip(tmp_path: Path) -> None:
    checkpoint.save(make_buffer(2, 10), tmp_path, 0)
    restored = make_buffer(2, 10)
    fill_random(restored, 5)
    report = checkpoint.load(tmp_path, restored)
    assert report.steps == restored.num_steps == 0 and len(restored) == 0


def test_only_stored_steps_are_written(tmp_path: Path) -> None:
    """A nearly empty buffer of large capacity makes a small file; size grows with steps."""
    spec = sr.Spec({"obs": sr.Field((64,), np.float32), "ctr": sr.Field((), np.int64)})
    step_bytes = 64 * 4 + 8 + 1 + 4 + 8 + 4 + 4  # fields + step_type, discount, episode id, gen, priority
    sizes = {}
    for steps in (25, 250):
        buf = sr.ReplayBuffer(spec, num_streams=4, stream_capacity=100_000, sampler="prioritized")
        for t in range(steps):
            buf.add({"obs": np.full((4, 64), t, np.float32), "ctr": np.arange(4) + 4 * t,
                     "step_type": np.full(4, 0 if t == 0 else 1, np.uint8)})
        directory = checkpoint.save(buf, tmp_path / str(steps), 1)
        sizes[steps] = (directory / "part-00000-of-00001.safetensors").stat().st_size
    capacity_bytes = 4 * 100_000 * step_bytes
    assert sizes[25] < 4 * 25 * step_bytes + 16_384 < capacity_bytes / 100
    grown = sizes[250] - sizes[25]
    assert 0.95 * 4 * 225 * step_bytes <= grown <= 4 * 225 * step_bytes + 4096


def test_part_is_a_plain_safetensors_file(tmp_path: Path) -> None:
    """Any safetensors reader opens a part (nothing pickled)."""
    from safetensors.numpy import load_file

    buf = make_buffer(2, 16)
    fill_random(buf, 20)
    directory = checkpoint.save(buf, tmp_path, 3)
    arrays = load_file(str(directory / "part-00000-of-00001.safetensors"))
    np.testing.assert_array_equal(np.sort(arrays["field.ctr"]), np.sort(stored_steps(buf)["ctr"]))
    np.testing.assert_array_equal(arrays["row_length"], np.minimum(testing.positions(buf), 16))


def test_manifest_records_ids_counts_and_files(tmp_path: Path) -> None:
    buf = make_buffer(2, 16)
    fill_random(buf, 30)
    directory = checkpoint.save(buf, tmp_path, 12, files={"note.json": b'{"step": 30, "note": "x"}'})
    assert directory == checkpoint_dir(tmp_path, 12)
    manifest = checkpoint.load_manifest(directory)
    assert manifest.checkpoint_id == 12 and manifest.num_shards == 1
    assert manifest.steps == buf.num_steps
    assert manifest.files["note.json"].bytes == len(b'{"step": 30, "note": "x"}') and not manifest.extra
    assert manifest.spec_fingerprint == SPEC.fingerprint
    assert checkpoint.is_complete(directory) and checkpoint.latest_complete(tmp_path) == 12
    body = json.loads((directory / "manifest.json").read_text())["body"]
    assert body == manifest.as_json()  # what it reads is what it wrote
    assert checkpoint.Manifest.parse(directory, body) == manifest


def test_keep_last_prunes_older_complete_checkpoints(tmp_path: Path) -> None:
    buf = make_buffer(2, 16)
    fill_random(buf, 10)
    for cid in (1, 2, 3, 4):
        checkpoint.save(buf, tmp_path, cid, keep_last=2)
    assert checkpoint.list_checkpoints(tmp_path) == [3, 4]
    checkpoint.save(buf, tmp_path, 5, keep_last=None)
    assert checkpoint.list_checkpoints(tmp_path) == [3, 4, 5]


def test_bad_arguments_write_nothing(tmp_path: Path) -> None:
    buf = make_buffer(2, 16)
    with pytest.raises(ConfigError):
        checkpoint.save(buf, tmp_path, -1)
    with pytest.raises(ConfigError):
        checkpoint.save(buf, tmp_path, 1, partial="keep")
    with pytest.raises(ConfigError):
        checkpoint.save(buf, tmp_path, 1, files={"x.json": object()})  # type: ignore[dict-item]
    with pytest.raises(ConfigError):
        checkpoint.save("not a buffer", tmp_path, 1)  # type: ignore[arg-type]
    assert checkpoint.list_checkpoints(tmp_path) == []


def test_saving_a_complete_checkpoint_again_is_skipped(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Re-saving an id would replace parts of the only complete checkpoint one by one."""
    buf = make_buffer(2, 16)
    fill_random(buf, 10)
    directory = checkpoint.save(buf, tmp_path, 5)
    files = {p.name: p.read_bytes() for p in directory.iterdir()}
    fill_random(buf, 10, seed=4)
    with caplog.at_level(logging.WARNING, logger="shardreplay.checkpoint"):
        assert checkpoint.save(buf, tmp_path, 5) == directory
    assert "already complete: not saved again" in caplog.text
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == files
    assert checkpoint.is_complete(directory)
