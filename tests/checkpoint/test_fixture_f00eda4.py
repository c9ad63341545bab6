"""A checkpoint written by main at f00eda4 (``fixtures/f00eda4``) still loads, as saved
and onto other shard counts, with the runtime learner's state beside it.

The fixture is two shards of 3 rows x 40 steps, prioritized, with episodes open at the
save: checkpoint 4 full, checkpoint 5 incremental (reading rows from checkpoint 4's
files), with the runtime learner's state as that version saved it (``extra`` and
``learner_state.pt``). It was written, with f00eda4's code, by
``tests/checkpoint/fixtures/make_f00eda4.py`` of commit 24907ac (removed since: the API it
calls is gone, and the fixture must never be rewritten by a newer version).
"""

from __future__ import annotations

import io
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import shardreplay as sr
from shardreplay import checkpoint, testing
from shardreplay.checkpoint.loading import load_shard
from shardreplay.checkpoint.manifest import load_checked
from shardreplay.checkpoint.plan import NewLayout
from shardreplay.checkpoint.records import ManifestPart, PartMeta
from shardreplay.checkpoint.refs import open_part
from shardreplay.errors import CheckpointFormatError
from shardreplay.runtime.learner.ingest import merge_stored
from shardreplay.runtime.policy_file import learner_records
from shardreplay.spec import StepType
from tests.checkpoint.helpers import fill_random, make_buffer, stored_steps

FIXTURES = Path(__file__).parent / "fixtures"
STREAMS, CAPACITY = 3, 40


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A copy of the fixture (a load must find it as saved, and never change it)."""
    return Path(shutil.copytree(FIXTURES / "f00eda4", tmp_path / "f00eda4"))


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "f00eda4-expected.npz", allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def _steps(ctr: np.ndarray, priority: np.ndarray) -> Counter[tuple[int, float]]:
    """Steps as (ctr, priority) pairs, counted (the two fills reused their clocks, so a
    ``ctr`` can occur twice in a row)."""
    return Counter(zip(ctr.tolist(), priority.tolist(), strict=True))


def _union(expected: dict[str, np.ndarray]) -> Counter[tuple[int, float]]:
    return sum((_steps(expected[f"{s}.ctr"], expected[f"{s}.priority"]) for s in (0, 1)), Counter())


def _filled(streams: int, capacity: int, seed: int) -> sr.ReplayBuffer:
    local = make_buffer(streams, capacity, seed=seed)
    fill_random(local, 7, seed=seed)  # content a load replaces
    return local


def test_fixture_has_what_it_claims(expected: dict[str, np.ndarray]) -> None:
    for s in (0, 1):  # episodes open at the save (an exact load must put them back open)
        types, rows = expected[f"{s}.step_type"], expected[f"{s}.row"]
        last = np.array([types[rows == r][-1] for r in range(STREAMS)])
        assert (last != StepType.LAST).any()
        assert expected[f"{s}.draws"] > 0 and len(np.unique(expected[f"{s}.priority"])) > 10


def test_both_checkpoints_are_complete(root: Path) -> None:
    assert checkpoint.list_checkpoints(root) == [4, 5]
    assert checkpoint.latest_complete(root) == 5
    assert all(checkpoint.is_complete(checkpoint.checkpoint_dir(root, c)) for c in (4, 5))
    manifest = checkpoint.load_manifest(checkpoint.checkpoint_dir(root, 5))
    assert manifest.version == 3 and all(p.refs for p in manifest.parts)  # incremental
    assert sorted(manifest.files) == ["learner_state.pt", *(f"part-0000{k}-of-00002.json" for k in (0, 1))]


def test_loads_as_saved_on_two_shards(root: Path, expected: dict[str, np.ndarray]) -> None:
    for s in (0, 1):
        local = _filled(STREAMS, CAPACITY, seed=50 + s)
        report = load_shard(checkpoint.checkpoint_dir(root, 5), local, s, 2)
        assert report.exact and (report.checkpoint_id, report.saved_shards) == (5, 2)
        assert report.saved_steps == sum(expected[f"{k}.ctr"].shape[0] for k in (0, 1))
        got = stored_steps(local)
        for name, values in got.items():
            np.testing.assert_array_equal(values, expected[f"{s}.{name}"], err_msg=name)
        np.testing.assert_array_equal(testing.positions(local), expected[f"{s}.positions"])
        counters = testing.sampler_counters(local)
        assert counters["max_priority"] == pytest.approx(float(expected[f"{s}.max_priority"]))
        assert counters["draws"] == int(expected[f"{s}.draws"])
        local.sample(8)  # the restored shard samples


@pytest.mark.parametrize(("n", "capacity"), [(1, 3 * CAPACITY), (3, CAPACITY)])
def test_loads_onto_other_shard_counts(root: Path, expected: dict[str, np.ndarray], n: int,
                                       capacity: int) -> None:
    layout = NewLayout.even(n, STREAMS, capacity)
    steps: Counter[tuple[int, float]] = Counter()
    for s in range(n):
        local = _filled(STREAMS, capacity, seed=60 + s)
        report = load_shard(checkpoint.checkpoint_dir(root, 5), local, s, n, layout=layout)
        assert not report.exact and report.dropped_steps == 0
        got = stored_steps(local)
        steps += _steps(got["ctr"], got["priority"])
    assert steps == _union(expected)


def test_public_load_with_the_learner_state(root: Path, expected: dict[str, np.ndarray]) -> None:
    local = make_buffer(STREAMS, 3 * CAPACITY, seed=3)
    report = checkpoint.load(root, local, files=("learner_state.pt",))
    assert report.checkpoint_id == 5 and report.steps == sum(_union(expected).values())
    state = torch.load(io.BytesIO(report.files["learner_state.pt"]), weights_only=True)
    torch.testing.assert_close(state["agent"]["q"]["weight"], torch.arange(6.0).reshape(2, 3))
    assert int(state["agent"]["updates"]) == 37
    # The runtime learner's record (saved as ``extra`` then): counters, best evaluation,
    # wall time, settings, stored chunks, as a resume reads them.
    assert report.manifest is not None
    records = learner_records(report.manifest)
    assert [dict(r.counters) for r in records] == [{"env_steps": 5000, "updates": 5, "version": 15}] * 2
    assert (records[0].best_eval, records[0].wall_s) == (12.5, 16.25)
    assert records[0].settings == {"run": {"total_env_steps": 5000}}
    ingest = [r.ingest for r in records]
    assert ingest == [{"stored": {"7": [[0, 9]], "9": [[2, 3]]}}, {"stored": {"8": [[0, 9]], "10": [[2, 3]]}}]
    assert merge_stored(ingest).state_dict() == {"stored": {"7": [[0, 9]], "8": [[0, 9]], "9": [[2, 3]],
                                                            "10": [[2, 3]]}}
    restored = report.manifest.restored
    assert restored is not None and (restored.checkpoint_id, restored.steps) == (2, 82)


def test_the_older_full_checkpoint_loads_too(root: Path) -> None:
    local = make_buffer(STREAMS, 3 * CAPACITY, seed=4)
    report = checkpoint.load(root, local, checkpoint_id=4)
    assert report.checkpoint_id == 4 and report.dropped_steps == 0
    assert report.steps == report.saved_steps > 0


def test_records_write_what_they_read(root: Path) -> None:
    """The typed records read the fixture and write it back as it is on disk: manifest,
    part descriptions and buffer metadata (one schema both ways)."""
    for cid in (4, 5):
        directory = checkpoint.checkpoint_dir(root, cid)
        manifest = checkpoint.load_manifest(directory)
        assert manifest.as_json() == load_checked(directory / "manifest.json")
        assert checkpoint.Manifest.parse(directory, manifest.as_json()) == manifest
        for part in manifest.parts:
            desc = load_checked(directory / part.file.replace(".safetensors", ".json"))
            assert part.description(manifest.spec) == desc
            assert ManifestPart.parse(desc, directory) == part
            with open_part(directory, part) as reader:
                meta = PartMeta.parse(reader.metadata["buffer_meta"], reader.path)
            assert PartMeta.parse(meta.as_text(), reader.path) == meta
            assert meta.max_priority > 1.0 and meta.draws > 0 and meta.sharding is not None


def test_buffer_meta_lacking_what_f00eda4_wrote_is_refused(root: Path) -> None:
    """f00eda4 wrote every counter, the key tag and the RNG of a part: one without them is
    malformed (older versions' parts are no longer read)."""
    directory = checkpoint.checkpoint_dir(root, 4)
    with open_part(directory, checkpoint.load_manifest(directory).parts[0]) as reader:
        saved = json.loads(reader.metadata["buffer_meta"])
    PartMeta.parse(json.dumps(saved), directory)
    for key in ("num_streams", "stream_capacity", "key_epoch", "key_tag", "rng", "next_episode_id",
                "stale_updates"):
        with pytest.raises(CheckpointFormatError, match="buffer metadata"):
            PartMeta.parse(json.dumps({k: v for k, v in saved.items() if k != key}), directory)


def test_a_part_entry_lacking_its_time_is_refused(root: Path) -> None:
    """f00eda4 recorded when each part was written (``created_unix_ms``), in its
    description and in the manifest: an entry without it is malformed."""
    directory = checkpoint.checkpoint_dir(root, 4)
    desc = load_checked(directory / "part-00000-of-00002.json")
    ManifestPart.parse(desc, directory)
    with pytest.raises(CheckpointFormatError, match="created_unix_ms"):
        ManifestPart.parse({k: v for k, v in desc.items() if k != "created_unix_ms"}, directory)
