"""Partial episodes at save time: ``seal`` keeps them as truncations, ``drop`` removes them.

Four streams of capacity 6 (``F`` FIRST, ``M`` MID, ``L`` LAST; ``|`` marks what the ring
still holds)::

    row 0   | F M L F M            ongoing tail "F M" (t=3..4)
    row 1   F M | M M L F M L      head overwritten: "M M L" (t=2..4)
    row 2   | F M M F M L          abandoned "F M M" (t=0..2): a FIRST came without a LAST
    row 3   F M M M | M M M M M M  an episode longer than the ring: both ends missing (t=4..9)

Partial: 4 episodes, 2 + 3 + 3 + 6 = 14 steps of 23 stored.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from shardreplay import checkpoint, testing
from shardreplay.checkpoint.manifest import load_checked
from tests.checkpoint.helpers import (
    FIRST,
    LAST,
    MID,
    T_SCALE,
    assert_same_distribution,
    make_buffer,
    stored_steps,
    union_distribution,
    window_table,
    write_timelines,
)

F, M, L = FIRST, MID, LAST
TIMELINES = [[F, M, L, F, M], [F, M, M, M, L, F, M, L], [F, M, M, F, M, L], [F] + [M] * 9]
PARTIAL = {"partial_episodes": 4, "partial_steps": 14}
COMPLETE_CTRS = {t * T_SCALE + r for r, ts in ((0, range(3)), (1, range(5, 8)), (2, range(3, 6)))
                 for t in ts}


def _saved(tmp_path: Path, window: int = 2) -> tuple:
    buf = make_buffer(4, 6, window=window)
    write_timelines(buf, TIMELINES)
    assert buf.num_steps == 23
    return buf, tmp_path / "ckpt"


def _by_ctr(buf) -> dict[int, tuple[int, float]]:
    s = stored_steps(buf)
    return {int(c): (int(t), float(d)) for c, t, d in zip(s["ctr"], s["step_type"], s["discount"],
                                                          strict=True)}


def _counts_everywhere(root: Path, expected: dict[str, int]) -> None:
    directory = checkpoint.checkpoint_dir(root, 1)
    part = load_checked(directory / "part-00000-of-00001.json")
    manifest = checkpoint.load_manifest(directory)
    assert part["partial"] == expected
    assert manifest.parts[0].partial == expected
    assert manifest.partial == expected


def test_seal_marks_first_surviving_step_first_and_last_stored_step_last(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    buf, root = _saved(tmp_path)
    original = _by_ctr(buf)
    caplog.set_level(logging.INFO, logger="shardreplay.checkpoint")
    checkpoint.save(buf, root, 1)  # seal is the default
    expected = {**PARTIAL, "sealed_episodes": 4, "sealed_steps": 14, "dropped_episodes": 0,
                "dropped_steps": 0}
    _counts_everywhere(root, expected)
    assert "partial episodes: 4 (14 steps), sealed 4 (14 steps), dropped 0 (0 steps)" in caplog.text

    # On the same shards and rows the restore is a faithful resume: sealing is undone.
    same = make_buffer(4, 6)
    assert checkpoint.load(root, same).exact
    assert _by_ctr(same) == original
    restored = make_buffer(4, 7)  # another layout: re-planned, the seal stays
    assert not checkpoint.load(root, restored).exact
    got = _by_ctr(restored)
    changes = {  # ctr -> (step type, discount) after sealing
        3 * T_SCALE + 0: (F, 1.0), 4 * T_SCALE + 0: (L, 1.0),    # ongoing tail
        2 * T_SCALE + 1: (F, 1.0), 4 * T_SCALE + 1: (L, 0.0),    # overwritten head keeps its LAST
        0 * T_SCALE + 2: (F, 1.0), 2 * T_SCALE + 2: (L, 1.0),    # abandoned
        4 * T_SCALE + 3: (F, 1.0), 9 * T_SCALE + 3: (L, 1.0),    # longer than the ring
    }
    assert got == {**original, **changes}
    # Nothing else changed, and with windows of 2 the sampling distribution is the same.
    assert_same_distribution(union_distribution([window_table(buf)]),
                             union_distribution([window_table(restored)]))


def test_seal_makes_truncated_ends_usable_for_longer_windows(tmp_path: Path) -> None:
    """With L = 3 the sealed LAST closes windows that were waiting for more steps."""
    buf, root = _saved(tmp_path, window=3)
    before = window_table(buf)
    checkpoint.save(buf, root, 1)
    restored = make_buffer(4, 7, window=3)  # another layout (the same one undoes the seal)
    checkpoint.load(root, restored)
    after = window_table(restored)
    assert set(before) < set(after)
    new = {after[k][0] for k in set(after) - set(before)}
    # the tail "F M" -> "F L"; "F M M" -> "F M L"; the long episode's last start
    assert new == {(3 * T_SCALE, 4 * T_SCALE), (1 * T_SCALE + 2, 2 * T_SCALE + 2),
                   (8 * T_SCALE + 3, 9 * T_SCALE + 3)}


def test_drop_removes_partial_episodes_and_counts_them(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    buf, root = _saved(tmp_path)
    original = _by_ctr(buf)
    caplog.set_level(logging.INFO, logger="shardreplay.checkpoint")
    checkpoint.save(buf, root, 1, partial="drop")
    expected = {**PARTIAL, "sealed_episodes": 0, "sealed_steps": 0, "dropped_episodes": 4,
                "dropped_steps": 14}
    _counts_everywhere(root, expected)
    assert checkpoint.load_manifest(checkpoint.checkpoint_dir(root, 1)).steps == 9
    assert "partial episodes: 4 (14 steps), sealed 0 (0 steps), dropped 4 (14 steps)" in caplog.text

    restored = make_buffer(4, 6)
    report = checkpoint.load(root, restored)
    assert report.steps == restored.num_steps == 9
    got = _by_ctr(restored)
    assert set(got) == COMPLETE_CTRS
    assert got == {c: original[c] for c in COMPLETE_CTRS}
    full = union_distribution([window_table(buf)])
    kept = {k: v for k, v in full.items() if k[0] in COMPLETE_CTRS}
    total = sum(kept.values())
    assert_same_distribution({k: v / total for k, v in kept.items()},
                             union_distribution([window_table(restored)]))


def test_no_partial_episodes_means_zero_counts(tmp_path: Path) -> None:
    buf = make_buffer(2, 8)
    write_timelines(buf, [[F, M, L], [F, L, F, M, M, L]])
    checkpoint.save(buf, tmp_path, 1, partial="drop")
    part = checkpoint.load_manifest(checkpoint.checkpoint_dir(tmp_path, 1)).parts[0]
    assert part.partial == dict.fromkeys(part.partial, 0)
    assert part.steps == 9 and part.episodes == 3


def test_smaller_rows_keep_the_newest_steps_of_a_long_episode(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Restored into rows of 4: each row keeps its newest episodes; the 6-step episode
    keeps its newest 4 steps and starts with FIRST."""
    buf, root = _saved(tmp_path)
    checkpoint.save(buf, root, 1)
    restored = make_buffer(4, 4)
    with caplog.at_level(logging.WARNING, logger="shardreplay.checkpoint"):
        report = checkpoint.load(root, restored)
    assert (report.dropped_episodes, report.dropped_steps) == (3, 11)
    assert "dropped its 3 oldest episodes (11 steps)" in caplog.text
    got = _by_ctr(restored)
    long_ep = {t * T_SCALE + 3 for t in range(6, 10)}
    assert long_ep <= set(got)
    assert got[6 * T_SCALE + 3] == (F, 1.0) and got[9 * T_SCALE + 3] == (L, 1.0)
    assert 5 * T_SCALE + 3 not in got
    assert set(got) == long_ep | {3 * T_SCALE, 4 * T_SCALE} | \
        {t * T_SCALE + 1 for t in (5, 6, 7)} | {t * T_SCALE + 2 for t in (3, 4, 5)}
    assert np.all(testing.positions(restored) <= 4)
