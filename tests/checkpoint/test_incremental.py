"""Incremental checkpoints: a chain of parts that refer to earlier files restores M -> N
exactly as full saves of the same content do, and pruning keeps every file a kept
checkpoint reads from (and removes them once no kept checkpoint does)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import checkpoint
from shardreplay.buffer.shard import STEP_ARRAYS
from shardreplay.checkpoint import episodes, saving
from shardreplay.checkpoint.format import PartReader
from shardreplay.checkpoint.loading import load_shard
from shardreplay.checkpoint.manifest import check_complete, incomplete_reason, referenced_checkpoints
from shardreplay.checkpoint.refs import MOST_REFS, open_part
from shardreplay.errors import CheckpointError
from shardreplay.storage.streams import StreamStorage
from tests.checkpoint.helpers import (
    FIRST,
    LAST,
    MID,
    _step,
    as_shard,
    assert_arrays_equal,
    fill_random,
    make_buffer,
    restored_arrays,
    shard_arrays,
)

STREAMS, CAPACITY = 3, 40


def _restored(root: Path, cid: int, n: int, capacity: int) -> list[dict[str, np.ndarray]]:
    return restored_arrays(root, cid, n, STREAMS, capacity)


def _own_field_rows(root: Path, cid: int) -> list[int]:
    """The rows of ``field.ctr`` each part of ``cid`` holds in its own file."""
    manifest = checkpoint.load_manifest(checkpoint.checkpoint_dir(root, cid))
    out = []
    for part in manifest.parts:
        with PartReader(manifest.directory / part.file, part) as reader:
            out.append(reader.entry("field.ctr")[1][0])
    return out


@pytest.mark.slow  # ~6 s: 6 checkpoints of 2 shards, each restored onto 3 and onto 2 shards
def test_incremental_chain_restores_m_to_n_as_full_saves_and_pruning_keeps_referenced(tmp_path: Path) -> None:
    inc, full = tmp_path / "inc", tmp_path / "full"
    locals_ = [make_buffer(STREAMS, CAPACITY, seed=k) for k in range(2)]
    for k, local in enumerate(locals_):
        fill_random(local, 30, shard=k, seed=k)
    for cid in range(1, 7):
        steps = 12 if cid < 5 else 60  # 5 and 6: every row wraps past what 1..4 saved
        for k, local in enumerate(locals_):
            fill_random(local, steps, shard=k, seed=10 * cid + k)
            checkpoint.save(as_shard(local, k, 2), inc, cid, incremental=True, keep_last=2)
            checkpoint.save(as_shard(local, k, 2), full, cid, keep_last=None)
        manifest = check_complete(checkpoint.checkpoint_dir(inc, cid))  # every block, referred files too
        assert manifest.version == (2 if cid == 1 else 5)
        if 1 < cid < 5:  # the 12 new steps of each row, of 40 stored
            assert _own_field_rows(inc, cid) == [12 * STREAMS] * 2
            assert _own_field_rows(full, cid) == [CAPACITY * STREAMS] * 2
        assert_arrays_equal(_restored(inc, cid, 3, CAPACITY * 2), _restored(full, cid, 3, CAPACITY * 2))
        exact = _restored(inc, cid, 2, CAPACITY)
        assert_arrays_equal(exact, [shard_arrays(local) for local in locals_])
        kept = checkpoint.list_checkpoints(inc)
        needed = {c for c in kept if c >= cid - 1}
        for c in sorted(needed):
            refs = referenced_checkpoints(checkpoint.load_manifest(checkpoint.checkpoint_dir(inc, c)))
            assert {checkpoint.checkpoint_dir(inc, x).name for x in kept} >= refs
            needed = needed | {int(r.split("-")[1]) for r in refs}
        assert set(kept) == needed  # nothing else survives pruning
        if cid == 4:
            assert 1 in kept  # not among the last two, but their rows are in its file
    assert checkpoint.list_checkpoints(inc) == [5, 6]  # rows of 1..4 all overwritten: pruned


def test_a_missing_referred_file_makes_the_checkpoint_incomplete(tmp_path: Path) -> None:
    local = make_buffer(STREAMS, CAPACITY)
    fill_random(local, 30)
    checkpoint.save(local, tmp_path, 1, incremental=True)
    fill_random(local, 5, seed=3)
    checkpoint.save(local, tmp_path, 2, incremental=True, keep_last=None)
    assert checkpoint.is_complete(checkpoint.checkpoint_dir(tmp_path, 2))
    # A flipped byte in the earlier file is found by verify (its blocks are listed twice).
    part = checkpoint.checkpoint_dir(tmp_path, 1) / "part-00000-of-00001.safetensors"
    data = bytearray(part.read_bytes())
    data[-3] ^= 0xFF
    part.write_bytes(bytes(data))
    assert incomplete_reason(checkpoint.checkpoint_dir(tmp_path, 2), missing=False) is not None
    part.unlink()
    assert not checkpoint.is_complete(checkpoint.checkpoint_dir(tmp_path, 2))
    with pytest.raises(CheckpointError, match="reads rows from"):
        checkpoint.load(tmp_path, make_buffer(STREAMS, CAPACITY), checkpoint_id=2)


def test_an_incremental_part_writes_only_new_rows_of_the_arrays_fixed_at_write(tmp_path: Path) -> None:
    """Every per-step array is held for the new steps only, as the fields are (version 4
    wrote step types, discounts and priorities whole, version 3 every per-step array):
    step types and discounts as written (sealed on reading), priorities by changed block."""
    local = make_buffer(STREAMS, CAPACITY)
    fill_random(local, 30)
    checkpoint.save(local, tmp_path, 1, incremental=True)
    fill_random(local, 5, seed=3)
    checkpoint.save(local, tmp_path, 2, incremental=True, keep_last=None)
    manifest = checkpoint.load_manifest(checkpoint.checkpoint_dir(tmp_path, 2))
    assert manifest.version == 5 and manifest.parts[0].chained_steps == \
        ("episode_id", "generation", "step_type", "discount", "priority")
    with PartReader(manifest.directory / manifest.parts[0].file, manifest.parts[0]) as reader:
        rows = {name: reader.entry(name)[1][0] for name in ("field.ctr", *STEP_ARRAYS)}
    new = 5 * STREAMS
    assert rows == {"field.ctr": new, "step_type": new, "discount": new, "episode_id": new,
                    "generation": new, "priority": 0}
    for n in (1, 2):  # as saved, and re-planned
        full = tmp_path / f"full-{n}"
        checkpoint.save(local, full, 2)
        assert_arrays_equal(_restored(tmp_path, 2, n, CAPACITY), _restored(full, 2, n, CAPACITY))
    assert_arrays_equal(_restored(tmp_path, 2, 1, CAPACITY), [shard_arrays(local)])


def test_an_incremental_save_reads_the_new_steps_of_the_per_step_arrays_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its time follows the steps written since, not the capacity: it copies the new steps
    (the segment table's own rows) of every per-step array and finds episodes in them only;
    the episode table and seals go on from the previous part's (before issue 42's fix it
    copied step types, discounts and episode ids whole and searched every stored step)."""
    local = make_buffer(STREAMS, CAPACITY)
    fill_random(local, 30)
    checkpoint.save(local, tmp_path, 1, incremental=True)
    fill_random(local, 5, seed=3)
    copied: list[int] = []
    searched: list[int] = []
    joined, find = StreamStorage._joined, episodes.find_episodes

    def spy(self: StreamStorage, arr: np.ndarray, *start: np.ndarray | None) -> np.ndarray:
        out = joined(self, arr, *start)
        copied.append(out.shape[0])
        return out

    def spy_find(step_type: np.ndarray, *args: np.ndarray) -> episodes.Episodes:
        searched.append(step_type.shape[0])
        return find(step_type, *args)

    monkeypatch.setattr(StreamStorage, "_joined", spy)
    monkeypatch.setattr(episodes, "find_episodes", spy_find)
    checkpoint.save(local, tmp_path, 2, incremental=True, keep_last=None)
    earlier = checkpoint.load_manifest(checkpoint.checkpoint_dir(tmp_path, 1)).parts[0].episodes
    # Each earlier episode as its first and last step (old: 2 x 15, 3 x 105 copied; 105 searched).
    assert copied == [5 * STREAMS] * 5 and searched == [2 * earlier + 5 * STREAMS]
    full = tmp_path / "full"
    checkpoint.save(local, full, 2)
    assert_arrays_equal(_restored(tmp_path, 2, 2, CAPACITY), _restored(full, 2, 2, CAPACITY))


def _write(local: sr.ReplayBuffer, steps: int, rng: np.random.Generator, last: np.ndarray, t: int) -> int:
    """``steps`` steps of some streams each (stream ``r`` with chance ``1 - r / 4``; stream 0's
    episode never ends, stream 1's mostly last a step or two), random discounts; returns the
    next write time (``last``: each stream's latest step type, updated)."""
    n = local.num_streams
    for now in range(t, t + steps):
        rows = np.flatnonzero(rng.random(n) < 1 - np.arange(n) / 4)
        u, k = rng.random(rows.shape[0]), rows.shape[0]
        types = np.where(u < np.array([0, 0.6, 0.1, 0.1, 0.1])[rows], LAST, MID)
        types = np.where((last[rows] == LAST) | (u > 0.97), FIRST, types).astype(np.uint8)
        disc = np.where(rng.random(k) < 0.5, rng.random(k), 1).astype(np.float32)
        local.add(_step(rows, now, 0, types, disc), stream_ids=rows, priorities=rng.uniform(0.1, 2, k))
        last[rows] = types
    return t + steps


_TABLES = ("episode", "seal.", "step_type", "discount")  # and episode_id


def test_a_chain_of_parts_continues_the_episode_table_as_a_full_save_finds_it(tmp_path: Path) -> None:
    """Across 32 parts, each taking its episode table and seals from the part before:
    episodes that span parts or the whole ring, wraps that cut episodes, rows without new
    steps, one-step episodes, parts that write old rows again (past MOST_REFS files) and a
    background save. Every part's table, seals and step arrays read as a full save's of the
    same content, and restore alike (exactly, and onto 2 shards)."""
    local, full, inc = make_buffer(5, CAPACITY), tmp_path / "full", tmp_path / "inc"
    rng, last, t = np.random.default_rng(5), np.full(5, LAST), 0
    sizes = [30, 1, 0, 13, 41, 2, *[1] * 18, 90, 3, 7, 1, 39, 2, 1, 5]
    for cid, steps in enumerate(sizes, 1):
        t = _write(local, steps, rng, last, t)
        if cid == 9:
            checkpoint.save_in_background(local, inc, cid, incremental=True, keep_last=3).wait()
        else:
            checkpoint.save(local, inc, cid, incremental=True, keep_last=3)
        checkpoint.save(local, full, cid, keep_last=1)
        dirs = [checkpoint.checkpoint_dir(root, cid) for root in (inc, full)]
        parts = [checkpoint.load_manifest(d).parts[0] for d in dirs]
        assert parts[0].chained == (cid > 1) and parts[0].partial == parts[1].partial
        with open_part(dirs[0], parts[0]) as a, open_part(dirs[1], parts[1]) as b:
            names = sorted(k for k in b.names() if k.startswith(_TABLES))
            assert names == sorted(k for k in a.names() if k.startswith(_TABLES))
            for name in names:
                np.testing.assert_array_equal(a.array(name), b.array(name), err_msg=f"{cid}: {name}")
        if cid % 8 == 0:
            assert_arrays_equal(restored_arrays(inc, cid, 1, 5, CAPACITY), [shard_arrays(local)])
            assert_arrays_equal(restored_arrays(inc, cid, 2, 5, CAPACITY),
                                restored_arrays(full, cid, 2, 5, CAPACITY))


def test_a_restore_starts_a_new_chain(tmp_path: Path) -> None:
    local = make_buffer(STREAMS, CAPACITY)
    fill_random(local, 30)
    checkpoint.save(local, tmp_path, 1, incremental=True)
    checkpoint.load(tmp_path, local)
    fill_random(local, 5, seed=4)
    checkpoint.save(local, tmp_path, 2, incremental=True)
    assert checkpoint.load_manifest(checkpoint.checkpoint_dir(tmp_path, 2)).version == 2  # full


# -- frame-stacked fields: chained too (an Atari run's checkpoints write its new stacks only)
K, FRAME = 4, (5, 6)
STACKED = sr.Spec({"obs": sr.Field((K, *FRAME), np.uint8, frame_stack=True), "ctr": sr.Field((), np.int64)})


def _stacked(capacity: int) -> sr.ReplayBuffer:
    return sr.ReplayBuffer(STACKED, num_streams=STREAMS, stream_capacity=capacity, window=2,
                           sampler="prioritized", seed=0)


class _Frames:
    """Stacks that shift one new random frame in per step; episodes end at random."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.stack = np.zeros((STREAMS, K, *FRAME), np.uint8)
        self.ended = np.ones(STREAMS, bool)
        self.t = 0

    def fill(self, buf: sr.ReplayBuffer, steps: int) -> None:
        obs = np.empty((STREAMS, steps, K, *FRAME), np.uint8)
        types = np.empty((STREAMS, steps), np.uint8)
        for t in range(steps):
            frame = self.rng.integers(0, 256, (STREAMS, *FRAME), dtype=np.uint8)
            types[:, t] = np.where(self.ended, 0, np.where(self.rng.random(STREAMS) < 0.05, 2, 1))
            shifted = np.concatenate([self.stack[:, 1:], frame[:, None]], axis=1)
            self.stack = np.where(self.ended[:, None, None, None], frame[:, None], shifted)
            obs[:, t] = self.stack
            self.ended = types[:, t] == 2
        ctr = self.t + np.arange(STREAMS * steps, dtype=np.int64).reshape(STREAMS, steps)
        self.t += STREAMS * steps
        buf.extend({"obs": obs, "ctr": ctr, "step_type": types},
                   priorities=self.rng.uniform(0.1, 2.0, (STREAMS, steps)).astype(np.float32))


def _stacked_restored(root: Path, cid: int, n: int, capacity: int) -> list[dict[str, np.ndarray]]:
    out = []
    for rank in range(n):
        local = _stacked(capacity)
        load_shard(checkpoint.checkpoint_dir(root, cid), local, rank, n)
        arrays = local.state_dict()["arrays"]
        out.append({k: v.numpy() for k, v in arrays.items() if k != "priority"})
    return out


@pytest.mark.parametrize("background", [False, True], ids=["save", "save_in_background"])
def test_frame_stacked_chain_writes_the_new_stacks_and_restores_m_to_n(tmp_path: Path,
                                                                       background: bool) -> None:
    """Before, a frame-stacked field made every part full (the whole buffer each time)."""
    inc, full = tmp_path / "inc", tmp_path / "full"
    buf, env = _stacked(CAPACITY), _Frames(1)
    env.fill(buf, 30)
    for cid in range(1, 5):
        for _ in range(1 if cid < 4 else 2):  # 4: every row wraps past what 1..3 saved
            env.fill(buf, 12 if cid < 4 else 30)
        if background:
            pending = checkpoint.save_in_background(buf, inc, cid, incremental=True, keep_last=2)
            pending.wait(60)
        else:
            checkpoint.save(buf, inc, cid, incremental=True, keep_last=2)
        checkpoint.save(buf, full, cid, keep_last=None)
        assert check_complete(checkpoint.checkpoint_dir(inc, cid)).version == (2 if cid == 1 else 5)
        manifest = checkpoint.load_manifest(checkpoint.checkpoint_dir(inc, cid))
        with PartReader(manifest.directory / manifest.parts[0].file, manifest.parts[0]) as reader:
            own = reader.entry("field.obs")[1][0]
        assert own == (12 * STREAMS if 1 < cid < 4 else CAPACITY * STREAMS)
        for n, capacity in ((1, CAPACITY), (2, CAPACITY)):  # 1 -> 1 (exact) and 1 -> 2 shards
            assert_arrays_equal(_stacked_restored(inc, cid, n, capacity),
                                _stacked_restored(full, cid, n, capacity))


def test_pruning_a_long_chain_checks_only_the_newest_checkpoints_and_keeps_what_the_full_scan_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def counted(directory: Path, *, hashes: bool = True) -> bool:
        calls.append(directory)
        return checkpoint.is_complete(directory, hashes=hashes)

    def at(cid: int) -> Path:
        return checkpoint.checkpoint_dir(tmp_path, cid)

    monkeypatch.setattr(saving, "is_complete", counted)  # the real check, counted (issue 42)
    local = make_buffer(STREAMS, CAPACITY)
    at(9).mkdir(parents=True)  # a save that died: incomplete
    for cid in [c for c in range(1, 25) if c != 9]:
        before = checkpoint.list_checkpoints(tmp_path)
        complete = [c for c in before if checkpoint.is_complete(at(c), hashes=False)]
        fill_random(local, 4, seed=cid, update_rounds=0)  # rows wrap every 10 saves
        calls.clear()
        checkpoint.save(local, tmp_path, cid, incremental=True, keep_last=2)
        assert len(calls) <= 1 + 2 + 1  # the save's own check, the 2 kept and the dead one
        keep = [*complete, cid][-2:]  # the full scan's rule, the reference
        needed = set().union(*(referenced_checkpoints(checkpoint.load_manifest(at(c))) for c in keep))
        expected = [c for c in sorted([*before, cid]) if c >= cid or c in keep or at(c).name in needed]
        assert checkpoint.list_checkpoints(tmp_path) == expected
    assert 5 <= len(checkpoint.list_checkpoints(tmp_path)) < 20  # a chain kept, and pruned as rows wrap



def test_a_long_chain_refers_to_at_most_most_refs_files_and_keeps_few_directories(tmp_path: Path) -> None:
    # 60 saves that wrap no row: before issue 42's bound each part referred to every earlier one, all kept.
    local, full = make_buffer(STREAMS, 400), tmp_path / "full"
    own_rows = 0
    for cid in range(1, 61):
        fill_random(local, 2, seed=cid, update_rounds=0)
        checkpoint.save(local, tmp_path, cid, incremental=True, keep_last=2)
        part = checkpoint.load_manifest(checkpoint.checkpoint_dir(tmp_path, cid)).parts[0]
        assert len(part.refs) <= MOST_REFS
        assert len(checkpoint.list_checkpoints(tmp_path)) <= MOST_REFS + 2
        own_rows += _own_field_rows(tmp_path, cid)[0]
        if cid % 30 == 0:  # exact, onto 1 shard and onto 2 as a full save of the same content
            checkpoint.save(local, full, cid)
            assert_arrays_equal(_restored(tmp_path, cid, 1, 400), [shard_arrays(local)])
            assert_arrays_equal(_restored(tmp_path, cid, 2, 400), _restored(full, cid, 2, 400))
    assert own_rows <= 2 * 60 * 2 * STREAMS  # a step's rows written at most about twice, not once per save
