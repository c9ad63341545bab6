"""``train --keep-rollouts`` in real runs: every chunk the learners stored is kept.

A short ``local`` run keeps in ``<run_dir>/rollouts`` exactly the steps it stored (the
summary's ``env_steps``), every chunk decodable, once, with its actor, streams, sequence,
policy version and insert time inside the run's wall time (Redis and the file spool: the
runs of test_train_faults.py keep theirs through an actor kill, a corrupt chunk and a Redis
restart). ``--resume R --no-replay`` then restores the
weights and counters but not the replay (its restore line says so; the final checkpoint
holds only the second life's steps) and keeps appending to the archive (the first
life's segments stay as they were); ``checkpoint inspect`` reports both lives' steps, and
a flipped bit in a kept segment (exit 1, the segment named).
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardreplay.cli.main import main as cli_main
from shardreplay.runtime.learner.wal import ROLLOUTS_DIR, archive_summary, iter_rollouts, log_files
from tests.support.train_runs import FAST, TrainRun, manifest_counters, newest_checkpoint

pytestmark = pytest.mark.distributed


def _train(args: list[str], log_dir: Path) -> tuple[dict[str, Any], str]:
    with TrainRun(args, log_dir) as run:
        assert run.wait(300) == 0, run.explain()
        assert run.leftovers() == [], run.explain()
        assert "Traceback" not in run.stderr(), run.explain()
        return run.summary(), run.stderr()


def _kept_files(run_dir: Path) -> list[Path]:
    """The archive's segments and those the ingest log keeps still (the newest interval, for
    a fallback past a damaged checkpoint): the readers read both."""
    return [p for p in log_files(run_dir / ROLLOUTS_DIR) + log_files(run_dir / "ingest") if p.stat().st_size]


def _check_kept(run_dir: Path, stored_steps: int, actors: int, since: float) -> list[Any]:
    """The archive holds ``stored_steps`` steps, each chunk once, sane ids and times."""
    kept = list(iter_rollouts(run_dir))
    assert sum(k.chunk.num_streams * k.chunk.num_steps for k in kept) == stored_steps
    assert len({k.chunk.identity for k in kept}) == len(kept)
    assert {k.chunk.actor_id for k in kept} == set(range(actors))
    for k in kept:
        assert since * 1e9 <= k.insert_ns <= time.time_ns()
        assert k.chunk.policy_version >= 0 and k.chunk.stream_ids.min() >= 0
        assert set(np.unique(k.chunk.steps["step_type"])) <= {0, 1, 2}
    return kept


@pytest.mark.timeout(600)
def test_local_run_keeps_its_rollouts_and_a_no_replay_resume_appends(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    started = time.time()
    first, _ = _train(["train", "--run-dir", str(run_dir), *FAST, "--learners", "2", "--actors", "2",
                       "--total-env-steps", "600", "--keep-rollouts"], tmp_path / "first")
    _check_kept(run_dir, first["env_steps"], actors=2, since=started)
    assert {p.name.split(".")[0] for p in _kept_files(run_dir)} == {"shard-0", "shard-1"}
    before = {p.name: p.read_bytes() for p in _kept_files(run_dir)}
    _, saved_manifest = newest_checkpoint(run_dir)
    saved = manifest_counters(saved_manifest)

    second, stderr = _train(["train", "--resume", str(run_dir), "--no-replay",
                             "--total-env-steps", str(saved["env_steps"] + 300)], tmp_path / "second")
    assert "without its replay (--no-replay): weights, optimizer and counters restored" in stderr
    assert second["resumed_from"]["replay"] is False and second["resumed_from"]["steps"] == 0
    assert second["updates"] > first["updates"]  # the counters went on
    _, manifest = newest_checkpoint(run_dir)
    new_steps = second["env_steps"] - saved["env_steps"]
    assert 0 < manifest.steps <= new_steps  # the replay started empty
    # Appended: the first life's segments as they were, the second life's beside them.
    after = {p.name: p for p in _kept_files(run_dir)}
    assert all(after[name].read_bytes() == data for name, data in before.items())
    assert len(after) > len(before)
    _check_kept(run_dir, second["env_steps"], actors=2, since=started)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["checkpoint", "inspect", str(run_dir), "--json", "--no-priorities"]) == 0
    report = json.loads(out.getvalue())["rollouts"]
    assert report == archive_summary(run_dir)
    assert report["steps"] == second["env_steps"] and report["damaged"] == []
    assert report["bytes"] == sum(p.stat().st_size for p in _kept_files(run_dir))
    assert started <= report["first_insert"] < report["last_insert"] <= time.time()

    victim = _kept_files(run_dir)[0]  # one flipped bit inside its first chunk
    raw = bytearray(victim.read_bytes())
    raw[100] ^= 0x10
    victim.write_bytes(bytes(raw))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["checkpoint", "inspect", str(run_dir), "--no-priorities"]) == 1
    assert f"DAMAGED {victim}@0" in out.getvalue()
