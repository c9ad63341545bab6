"""``shardreplay train`` over uneven layouts, saved and resumed on another number of learners.

The matrix (learners x actors -> learners x actors): 2x4 -> 3x4, 3x2 -> 2x2, 1x3 -> 4x3,
4x5 -> 3x2, with 4 envs per actor, so stream rows split unevenly over the shards (16
streams over 3 learners: 8, 4, 4 rows; 8 streams over 3: 3, 3, 2, an actor feeding two
shards). Each cell runs a short real run, until a checkpoint shows every shard fed, then
resumes it on the new count likewise, and checks: every shard of both lives was fed (its part
holds steps the shard ingested itself), and the resume restored every saved step
(restored == saved, nothing dropped: the capacity is ample). Before the fix the 2x4 ->
3 resume was refused ("6344 steps restored and 0 dropped, but the checkpoint holds
6304"), and 3x2 left shard 2 empty.

The 2x4 cell also tries a resume that must be refused (another environment: the spec
differs) and checks that it left the run directory byte-identical (config.json,
run.json and the learner life included), so the next ``--auto-resume`` goes on.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from shardreplay import checkpoint
from shardreplay.runtime.run_identity import read_identity
from tests.support.train_runs import (
    FAST,
    TrainRun,
    manifest_counters,
    manifest_steps,
    newest_checkpoint,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

COMMON = [*FAST, "--hidden", "32", "32", "--envs-per-actor", "4", "--chunk-steps", "4",
          "--samples-per-insert", "8"]
STEPS = 1600  # per life, at least: little training (2x4: 80-90 updates)


def _tree_digest(root: Path) -> dict[str, str]:
    """Every file and directory under ``root`` with a digest of its bytes."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            for p in sorted(root.rglob("*"))}


def _unfed(manifest: checkpoint.Manifest) -> list[str]:
    """Why each shard without a step it took itself (beyond those restored) counts as unfed."""
    out = []
    for p in manifest.parts:
        restored = 0 if p.restored is None else p.restored.steps
        if p.steps <= restored:
            out.append(f"shard {p.shard} took no chunk: {p.steps} steps, {restored} of them restored")
    return out


def _every_shard_fed(manifest: checkpoint.Manifest, learners: int) -> None:
    assert len(manifest.parts) == learners
    assert not (unfed := _unfed(manifest)), unfed


def _refused_resume_changes_nothing(run_dir: Path, log_dir: Path) -> None:
    """Refused on every rank (another environment: the spec differs), from an older
    checkpoint (``--checkpoint-id``: the newer ones are set aside only after a restore)."""
    before = _tree_digest(run_dir)
    life = read_identity(run_dir)
    older = checkpoint.list_checkpoints(run_dir / "checkpoints")[-2]
    with TrainRun(["train", "--resume", str(run_dir), "--checkpoint-id", str(older), "--learners", "3",
                   "--env-id", "Acrobot-v1", *COMMON], log_dir) as run:
        assert run.wait(120) != 0, run.explain()
        assert run.leftovers() == [], run.explain()
        assert "saved with spec" in run.stderr(), run.explain()
        assert "Traceback" not in run.stderr(), run.explain()  # a refusal, not a crash
        last = run.stderr().strip().splitlines()[-1]
        assert last.count("CheckpointFormatError") == 1, last  # the ranks' common refusal, said once
    assert _tree_digest(run_dir) == before
    assert read_identity(run_dir) == life


def _newest_complete(run_dir: Path, after: int) -> checkpoint.Manifest | None:
    """The manifest of the newest complete checkpoint with an id above ``after``, if any."""
    root = run_dir / "checkpoints"
    for cid in reversed(checkpoint.list_checkpoints(root)):
        directory = checkpoint.checkpoint_dir(root, cid)
        if cid > after and checkpoint.is_complete(directory):
            return checkpoint.load_manifest(directory)
    return None


def _fed(manifest: checkpoint.Manifest | None, learners: int, env_steps: int) -> bool:
    """Whether ``manifest`` has a part per learner, each holding steps its shard took
    itself, and counts ``env_steps`` or more."""
    return (manifest is not None and len(manifest.parts) == learners and not _unfed(manifest)
            and manifest_counters(manifest)["env_steps"] >= env_steps)


def _until_every_shard_fed(args: list[str], run_dir: Path, log_dir: Path, learners: int,
                           env_steps: int) -> dict:
    """Train (checkpoints every 20 updates) until a checkpoint shows every shard fed and
    ``env_steps`` counted, then stop it with SIGTERM (a clean stop: final checkpoint,
    summary, exit 0). A step budget alone raced the actors' start: a shard that only a
    late actor feeds could see the others spend the whole budget first."""
    root = run_dir / "checkpoints"
    after = max(checkpoint.list_checkpoints(root), default=-1) if root.exists() else -1
    with TrainRun([*args, "--total-env-steps", str(10**9), "--checkpoint-interval-updates", "20"],
                  log_dir) as run:
        wait_until(lambda: _fed(_newest_complete(run_dir, after), learners, env_steps), 200,
                   f"a checkpoint with {env_steps}+ steps and every one of {learners} shards fed", run)
        run.terminate_launcher()
        assert run.wait(120) == 0, run.explain()
        assert run.leftovers() == [], run.explain()
        return run.summary()


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("learners", "actors", "resumed", "resumed_actors"),
                         [(2, 4, 3, 4), (3, 2, 2, 2), (1, 3, 4, 3), (4, 5, 3, 2)])
def test_uneven_layouts_feed_every_shard_and_resume_with_every_step(
        tmp_path: Path, learners: int, actors: int, resumed: int, resumed_actors: int) -> None:
    run_dir = tmp_path / "run"
    _until_every_shard_fed(["train", "--run-dir", str(run_dir), *COMMON, "--learners", str(learners),
                            "--actors", str(actors)], run_dir, tmp_path / "first", learners, STEPS)
    saved_dir, saved = newest_checkpoint(run_dir)
    _every_shard_fed(saved, learners)
    if (learners, actors) == (2, 4):
        _refused_resume_changes_nothing(run_dir, tmp_path / "refused")
    # Read now: the resumed run's pruning deletes this checkpoint and its learner records.
    saved_counters = manifest_counters(saved)
    before = saved_counters["env_steps"]
    summary = _until_every_shard_fed(["train", "--resume", str(run_dir), "--learners", str(resumed),
                                      "--actors", str(resumed_actors)], run_dir, tmp_path / "second",
                                     resumed, before + STEPS)
    restored = summary["resumed_from"]
    assert restored["checkpoint"] == saved_dir.name and restored["shards"] == resumed
    assert restored["steps"] == restored["saved_steps"] == manifest_steps(saved)
    assert restored["dropped_steps"] == 0
    _new_dir, new = newest_checkpoint(run_dir)
    assert new.num_shards == resumed and summary["updates"] > saved_counters["updates"]
    assert new.restored is not None and new.restored.steps == manifest_steps(saved)
    _every_shard_fed(new, resumed)
    assert manifest_steps(new) == manifest_steps(saved) + summary["env_steps"] - before
