"""``shardreplay export RUN --minari ID`` on a run directory: the run's env gives the
spaces, its stream layout the actor and stream of each saved row. The run is made by
hand (its config.json and a 2-part checkpoint), not trained: the steps are what a
training run stores, at a fraction of the CPU. The slow test runs docs/offline.md's
commands (keep, export both ways, prefill, offline) with small budgets."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import checkpoint
from shardreplay.cli.main import main
from shardreplay.runtime.settings import TrainSettings
from shardreplay.spec import StepType
from tests.checkpoint.helpers import as_shard
from tests.support.train_runs import FAST, TrainRun

minari = pytest.importorskip("minari")
from shardreplay.offline import CheckpointEpisodes, ChunkEpisodes, prefill  # noqa: E402
from shardreplay.runtime.learner.loop import versioned  # noqa: E402
from shardreplay.spec.fields import VERSION_FIELD as VERSION  # noqa: E402

F, M, L = int(StepType.FIRST), int(StepType.MID), int(StepType.LAST)
LAST = L

SPEC = sr.Spec({"obs": sr.Field((4,), np.float32), "action": sr.Field((), np.int64),
                "reward": sr.Field((), np.float32)})


def _run(run_dir: Path) -> None:
    """A CartPole run of 2 learners, 2 actors of 2 envs: shard k holds actor k's envs."""
    settings = TrainSettings().updated({"learners": 2, "actors": 2, "envs_per_actor": 2})
    settings = settings.with_run_dir(run_dir)
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(settings.stored()))
    for k in range(2):
        buf = sr.ReplayBuffer(SPEC, num_streams=2, stream_capacity=32, sampler="prioritized")
        for t in range(40):
            st = StepType.FIRST if t % 10 == 0 else StepType.LAST if t % 10 == 9 else StepType.MID
            buf.add({"obs": np.full((2, 4), 100 * k + 10 * np.arange(2)[:, None] + t % 10, np.float32),
                     "action": np.ones(2, np.int64), "reward": np.ones(2, np.float32),
                     "step_type": np.full(2, int(st), np.uint8)})
        checkpoint.save(as_shard(buf, k, 2), run_dir / "checkpoints", 5)


def test_export_names_actor_and_stream_and_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "datasets"))
    _run(tmp_path / "run")
    assert main(["export", str(tmp_path / "run"), "--minari", "sr/cartpole-v0", "--partial", "drop",
                 "--jobs", "2"]) == 0  # a process per shard, each naming its rows' actor and stream
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["counts"]["dropped_episodes"] == 4  # each row's ring cut its oldest episode
    # Saved without versions (a plain buffer, or a run before they were kept): -1, counted.
    assert summary["counts"]["unversioned_steps"] == summary["counts"]["saved_steps"] == 128
    dataset = minari.load_dataset("sr/cartpole-v0")
    assert dataset.spec.env_spec.id == "CartPole-v1" and dataset.total_episodes == 4 * 3  # 3 whole a row
    for ep in dataset.iterate_episodes():
        shard, row = divmod(int(ep.observations[0, 0]) // 10, 10)
        assert (ep.infos["actor"] == shard).all() and (ep.infos["stream"] == row).all()
        assert ep.observations.shape == (10, 4) and ep.truncations[-1]  # discount 1 at LAST
        assert (ep.infos["policy_version"] == -1).all()
    assert main(["export", str(tmp_path / "run"), "--minari", "sr/cartpole-v0"]) == 2
    assert "exists already" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "run"), "--minari", "sr/other-v0", "--which", "best"]) == 2
    assert main(["export", str(tmp_path / "run")]) == 2  # neither --out nor --minari


def test_a_run_resumed_from_a_checkpoint_without_versions_keeps_none(tmp_path: Path) -> None:
    """A training run's shards store each step's policy version, unless they restore a
    checkpoint saved without it (as saved: the restore needs the same spec)."""
    assert versioned(SPEC) == versioned(SPEC, tmp_path) == sr.Spec({**SPEC.fields, VERSION: ((), np.int64)})
    _run(tmp_path / "run")
    assert versioned(SPEC, tmp_path / "run" / "checkpoints") == SPEC
    buf = sr.ReplayBuffer(versioned(SPEC), num_streams=1, stream_capacity=8)
    buf.add({"obs": np.zeros((1, 4), np.float32), "action": [0], "reward": [0.0], VERSION: [7],
             "step_type": [F]})
    checkpoint.save(buf, tmp_path / "new", 1)
    assert versioned(SPEC, tmp_path / "new") == buf.spec


def test_versions_move_with_their_steps_when_two_shards_restore_as_one_of_three_rows(tmp_path: Path) -> None:
    """The version field is a per-step field: an M -> N restore places it with its step,
    and the next checkpoint's export gives each step its own (version = obs[0] here)."""
    for k in range(2):
        buf = sr.ReplayBuffer(versioned(SPEC), num_streams=2, stream_capacity=16)
        for t in range(12):
            v = 1000 * k + 10 * np.arange(2) + t
            st = F if t % 6 == 0 else L if t % 6 == 5 else M
            buf.add({"obs": np.repeat(v[:, None], 4, 1).astype(np.float32), "action": [0, 0],
                     "reward": [0.0, 0.0], VERSION: v, "step_type": [st, st]})
        checkpoint.save(as_shard(buf, k, 2), tmp_path / "a", 1)
    one = sr.ReplayBuffer(versioned(SPEC), num_streams=3, stream_capacity=40)
    assert not checkpoint.load(tmp_path / "a", one).exact  # 2 parts of 2 rows -> 1 shard of 3
    checkpoint.save(one, tmp_path / "b", 2)
    episodes = CheckpointEpisodes(tmp_path / "b")
    got = [(ep.obs[:, 0].astype(np.int64).tolist(), ep.policy_version.tolist()) for ep in episodes]
    assert len(got) == 8 and all(obs == version for obs, version in got)
    assert episodes.counts["unversioned_steps"] == 0 and episodes.counts["saved_steps"] == 48


def _chunk(actor: int, streams: list[int], types: list[list[int]], version: int, start: float
           ) -> SimpleNamespace:
    """A stand-in of transport.codec.Chunk: obs[.., 0] = start + t + 100 * stream."""
    t = np.asarray(types, np.uint8)
    obs = start + np.arange(t.shape[1])[None, :, None] + 100 * np.asarray(streams)[:, None, None]
    steps = {"obs": np.repeat(obs, 4, 2).astype(np.float32), "step_type": t,
             "action": np.ones(t.shape, np.int64), "reward": np.ones(t.shape, np.float32),
             "discount": np.where(t == LAST, 0, 1).astype(np.float32)}
    return SimpleNamespace(actor_id=actor, stream_ids=np.asarray(streams), policy_version=version,
                           priorities=None, steps=steps)


@pytest.mark.parametrize("partial", ["seal", "drop"])
def test_chunks_reassemble_into_episodes_per_actor_and_stream(partial: str) -> None:
    """Two actors' chunks interleaved; an episode spans chunks; a head and a tail partial."""
    chunks = [_chunk(0, [0, 1], [[M, M, L, F], [F, M, M, M]], 1, 0),   # actor 0 stream 0 starts headless
              _chunk(1, [0], [[F, M, M, M]], 1, 0),
              _chunk(0, [0, 1], [[M, L, F, M], [M, L, F, L]], 2, 4),   # stream 0 ends open
              _chunk(1, [0], [[M, L, F, M]], 3, 4)]                      # actor 1 ends open
    episodes = ChunkEpisodes(chunks, partial)
    got = {(e.actor, e.stream, int(e.obs[0, 0])): (e.obs.shape[0], e.policy_version.tolist(), e.terminated)
           for e in episodes}
    whole = {(0, 0, 3): (3, [1, 2, 2], True), (0, 1, 100): (6, [1, 1, 1, 1, 2, 2], True),
             (0, 1, 106): (2, [2, 2], True), (1, 0, 0): (6, [1, 1, 1, 1, 3, 3], True)}
    partial_eps = {(0, 0, 0): (3, [1, 1, 1], True), (0, 0, 6): (2, [2, 2], False),
                   (1, 0, 6): (2, [3, 3], False)}
    assert got == (whole | partial_eps if partial == "seal" else whole)
    assert episodes.counts[f"{'sealed' if partial == 'seal' else 'dropped'}_episodes"] == 3
    assert episodes.counts["partial_steps"] == 7 and episodes.counts["saved_steps"] == 24


@pytest.mark.slow
def test_train_keep_rollouts_then_export_both_ways_and_prefill(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A real 2-learner run (about 15 CPU-s): its rollouts and its checkpoint both export,
    every kept step once; the checkpoint's export imports back into 3 shards' worth."""
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "datasets"))
    run_dir = tmp_path / "run"
    args = ["train", "--run-dir", str(run_dir), "--keep-rollouts", "--total-env-steps", "1500",
            "--actors", "2", "--learners", "2", "--envs-per-actor", "2", *FAST]
    with TrainRun(args, tmp_path) as run:
        assert run.wait(240) == 0, run.explain()
    assert main(["export", str(run_dir), "--minari", "sr/kept-v0", "--from", "rollouts",
                 "--format", "arrow"]) == 0
    assert main(["export", str(run_dir), "--minari", "sr/ckpt-v0"]) == 0
    kept, ckpt = minari.load_dataset("sr/kept-v0"), minari.load_dataset("sr/ckpt-v0")
    meta = kept.storage.metadata["shardreplay"]
    assert kept.total_steps + kept.total_episodes + meta["counts"].get("short_steps", 0) == \
        meta["counts"]["saved_steps"] >= 1500
    # The checkpoint's steps carry the version of the chunk that brought each (as kept).
    made = {(int(e.infos["actor"][0]), int(e.infos["stream"][0]), o.tobytes()): int(v)
            for e in kept.iterate_episodes()
            for o, v in zip(e.observations, e.infos["policy_version"], strict=True)}
    runs: dict[tuple[int, int], list[int]] = {}  # each stream's versions in time order
    for e in ckpt.iterate_episodes():
        key = (int(e.infos["actor"][0]), int(e.infos["stream"][0]))
        assert e.infos["policy_version"].tolist() == [made[(*key, o.tobytes())] for o in e.observations]
        runs.setdefault(key, []).extend(e.infos["policy_version"].tolist())
    assert min(min(v) for v in runs.values()) >= 0 and len(runs) == 4
    assert all(np.diff(v).min() >= 0 and v[-1] > v[0] for v in runs.values()), runs
    assert ckpt.storage.metadata["shardreplay"]["counts"]["unversioned_steps"] == 0
    buf = sr.ReplayBuffer(SPEC, num_streams=6, stream_capacity=2000, sampler="prioritized")
    report = prefill(buf, "sr/ckpt-v0")
    assert report["steps"] == ckpt.total_steps + ckpt.total_episodes == buf.num_steps
    # train --prefill: a fresh 2-learner run starts from the dataset (its final checkpoint
    # holds the dataset's steps besides its own 300).
    warm = tmp_path / "warm"
    args = ["train", "--run-dir", str(warm), "--prefill", "minari:sr/ckpt-v0", "--total-env-steps", "300",
            "--actors", "2", "--learners", "2", "--envs-per-actor", "2", "--min-replay", "50", *FAST]
    with TrainRun(args, tmp_path, prefix="warm-") as run:
        assert run.wait(240) == 0, run.explain()
    root = warm / "checkpoints"
    manifest = checkpoint.load_manifest(checkpoint.checkpoint_dir(root, checkpoint.latest_complete(root)))
    assert sum(p.steps for p in manifest.parts) >= report["steps"] + 300
    # train --offline: the dataset alone, no actor; evaluation as usual; stops on time.
    cold = tmp_path / "offline"
    args = ["train", "--run-dir", str(cold), "--offline", "minari:sr/ckpt-v0", "--learners", "2",
            *FAST, "--max-minutes", "0.2", "--eval-interval-updates", "100"]
    with TrainRun(args, tmp_path, prefix="offline-") as run:
        assert run.wait(240) == 0, run.explain()
        assert not run.actors()
    summary = json.loads((cold / "summary.json").read_text())
    assert summary["env_steps"] == 0 and summary["updates"] > 100, summary
    # Two ranks' loops start apart: whichever clock passes --max-minutes first, it ended on time.
    assert summary["stopped_by"] == "time" and summary["dataset_steps"] == report["steps"], summary
    assert f"after {summary['updates']:,} updates on the {report['steps']:,} steps of minari:sr/ckpt-v0 " \
           "(offline)" in run.stdout(), run.stdout()


def test_prefill_and_offline_take_a_minari_id_and_offline_needs_no_actor() -> None:
    from shardreplay.errors import ConfigError

    assert TrainSettings().updated({"prefill": "minari:sr/x-v0"}).replay.prefill == "minari:sr/x-v0"
    assert TrainSettings().updated({"offline": "minari:sr/x-v0", "actors": 0}).total_actors == 0
    with pytest.raises(ConfigError, match="minari:ID"):
        TrainSettings().updated({"prefill": "sr/x-v0"})
    with pytest.raises(ConfigError, match="not both"):
        TrainSettings().updated({"prefill": "minari:a-v0", "offline": "minari:a-v0"})
    with pytest.raises(ConfigError, match="no actor would feed"):
        TrainSettings().updated({"actors": 0})
