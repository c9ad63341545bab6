"""Checkpoint -> Minari dataset -> replay: the steps come back bit for bit with their
priorities; the prioritized draw after the import follows them (chi-square); M = 2
saved shards import into N = 3; a parallel export (a process per shard) writes the
serial one's dataset; TorchRL's MinariExperienceReplay samples an export; a killed or
failed export leaves nothing under its id, and no process. Every dataset lives in a tmp
MINARI_DATASETS_PATH."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import checkpoint
from shardreplay.distributed.runner import InlineRunner
from shardreplay.errors import ConfigError, ShardReplayError
from shardreplay.spec import StepType
from tests.checkpoint.helpers import as_shard

minari = pytest.importorskip("minari")
gym = pytest.importorskip("gymnasium")
from shardreplay.offline import CheckpointEpisodes, export_checkpoint, prefill  # noqa: E402

FIRST, MID, LAST = int(StepType.FIRST), int(StepType.MID), int(StepType.LAST)
SPEC = sr.Spec({"obs": sr.Field((3,), np.float32), "action": sr.Field((), np.int64),
                "reward": sr.Field((), np.float32)})
SPACES = {"observation_space": gym.spaces.Box(-np.inf, np.inf, (3,), np.float32),
          "action_space": gym.spaces.Discrete(4)}
ALPHA = 0.7
ROWS, CAP, STEPS = 2, 64, 100  # the ring overwrites: partial heads and open tails to seal


@pytest.fixture(autouse=True)
def datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "datasets"))
    return tmp_path / "datasets"


def _save_run(root: Path, num_shards: int = 2) -> None:
    """Checkpoint 1 of ``num_shards`` parts; obs[0] counts steps (unique), episodes of
    random lengths, the LAST step's action and reward zero (as the gym writer stores)."""
    rng = np.random.default_rng(7)
    ctr = 0
    for k in range(num_shards):
        buf = sr.ReplayBuffer(SPEC, num_streams=ROWS, stream_capacity=CAP, sampler="prioritized",
                              alpha=ALPHA, seed=k)
        pos, length = np.zeros(ROWS, np.int64), rng.integers(2, 20, ROWS)
        for _ in range(STEPS):
            types = np.where(pos == 0, FIRST, np.where(pos == length - 1, LAST, MID)).astype(np.uint8)
            pos += 1
            done = types == LAST
            pos[done], length[done] = 0, rng.integers(2, 20, int(done.sum()))
            obs = np.stack([np.full(3, ctr + i, np.float32) for i in range(ROWS)])
            ctr += ROWS
            last = types == LAST
            buf.add({"obs": obs, "action": np.where(last, 0, rng.integers(0, 4, ROWS)),
                     "reward": np.where(last, 0, rng.random(ROWS)).astype(np.float32), "step_type": types,
                     "discount": np.where(last & (rng.random(ROWS) < 0.7), 0.0, 1.0).astype(np.float32)},
                    priorities=rng.random(ROWS) * 3 + 0.01)
        checkpoint.save(as_shard(buf, k, num_shards), root, 1)


def _by_first_obs(arrays: dict[str, np.ndarray]) -> dict[float, dict[str, np.ndarray]]:
    """Episodes of exported steps keyed by their first obs (unique)."""
    out = {}
    st = arrays["step_type"]
    starts = np.flatnonzero(st == FIRST)
    ends = np.append(starts[1:], st.shape[0])
    for s, e in zip(starts, ends, strict=True):
        out[float(arrays["field.obs"][s, 0])] = {k: arrays[k][s:e] for k in
                                                 ("field.obs", "field.action", "field.reward", "step_type",
                                                  "discount", "priority")}
    return out


def _steps(buf: sr.ReplayBuffer) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in buf.state_dict()["arrays"].items()}


def _source_episodes(root: Path) -> dict[float, dict[str, np.ndarray]]:
    """The checkpoint's episodes as the export sees them (sealed), as stored steps."""
    eps = {}
    for ep in CheckpointEpisodes(root):
        k = ep.obs.shape[0]
        st = np.full(k, MID, np.uint8)
        st[0], st[-1] = FIRST, LAST
        disc = np.ones(k, np.float32)
        disc[-1] = 0.0 if ep.terminated else 1.0
        action, reward = ep.action.copy(), ep.reward.copy()
        action[-1], reward[-1] = 0, 0  # a sealed tail's last action leads nowhere: padding
        eps[float(ep.obs[0, 0])] = {"field.obs": ep.obs, "field.action": action, "field.reward": reward,
                                    "step_type": st, "discount": disc, "priority": ep.priority}
    return eps


@pytest.mark.parametrize("fmt", ["hdf5", "arrow"])
def test_round_trip_is_bit_for_bit_with_priorities_and_the_prioritized_draw(tmp_path: Path, fmt: str) -> None:
    from scipy import stats

    _save_run(tmp_path / "ck")
    summary = export_checkpoint(tmp_path / "ck", "sr/roundtrip-v0", **SPACES, data_format=fmt)
    counts = summary["counts"]
    assert counts["saved_steps"] == 2 * ROWS * CAP
    assert counts["sealed_episodes"] > 0  # the ring cut heads and tails: sealed and counted
    assert summary["steps"] + summary["episodes"] + counts.get("short_steps", 0) == counts["saved_steps"]
    dataset = minari.load_dataset("sr/roundtrip-v0")
    assert dataset.storage.metadata["shardreplay"]["counts"] == counts
    assert dataset.total_episodes == summary["episodes"]
    for ep in dataset.iterate_episodes():
        t = len(ep.rewards)
        assert ep.observations.shape == (t + 1, 3) and ep.actions.shape == (t,)
        assert ep.terminations[-1] != ep.truncations[-1]
        assert not (ep.terminations[:-1] | ep.truncations[:-1]).any()
        assert np.asarray(ep.infos["priority"]).shape == (t + 1,)

    buf = sr.ReplayBuffer(SPEC, num_streams=4, stream_capacity=4 * CAP, sampler="prioritized", alpha=ALPHA,
                          seed=3)
    report = prefill(buf, "sr/roundtrip-v0")
    assert report == {"episodes": summary["episodes"], "steps": summary["steps"] + summary["episodes"]}
    source, imported = _source_episodes(tmp_path / "ck"), _by_first_obs(_steps(buf))
    assert source.keys() == imported.keys()
    for key, ep in source.items():
        for name, values in ep.items():
            got = imported[key][name]
            assert got.dtype == values.dtype and got.tobytes() == values.tobytes(), (key, name)

    # The prioritized draw after the import: P(start) = p^alpha / sum over valid starts.
    steps = _steps(buf)
    valid = steps["step_type"] != LAST
    ids, prio = steps["field.obs"][valid, 0], steps["priority"][valid].astype(np.float64)
    expected = prio ** ALPHA / (prio ** ALPHA).sum()
    draws = np.concatenate([buf.sample(256).data["obs"][:, 0, 0].numpy() for _ in range(200)])
    counts_drawn = np.bincount(np.searchsorted(np.sort(ids), draws), minlength=ids.shape[0])
    order = np.argsort(ids)
    _, p_value = stats.chisquare(counts_drawn, expected[order] * draws.shape[0])
    assert p_value > 1e-3, p_value


def test_two_saved_shards_import_into_three(tmp_path: Path) -> None:
    _save_run(tmp_path / "ck", num_shards=2)
    summary = export_checkpoint(tmp_path / "ck", "sr/m2n3-v0", **SPACES)
    shards = []
    for rank in range(3):
        local = sr.ReplayBuffer(SPEC, num_streams=2, stream_capacity=2 * CAP, sampler="prioritized",
                                alpha=ALPHA)
        stub = as_shard(local, rank, 3)
        stub._runner = InlineRunner(None, None)  # what write_lock holds (nothing, inline)
        prefill(stub, "sr/m2n3-v0")
        shards.append(_steps(local))
    merged: dict[float, dict[str, np.ndarray]] = {}
    for steps in shards:
        eps = _by_first_obs(steps)
        assert not merged.keys() & eps.keys()  # each episode in one shard only
        merged.update(eps)
    assert merged.keys() == _source_episodes(tmp_path / "ck").keys()
    sizes = [int(s["row_length"].sum()) for s in shards]
    assert sum(sizes) == summary["steps"] + summary["episodes"]
    assert max(sizes) - min(sizes) <= 20  # dealt by steps: at most one episode apart
    for s in shards:  # and within a shard, across its streams
        assert np.ptp(s["row_length"]) <= 20


def _episodes(dataset_id: str) -> list[dict[str, np.ndarray]]:
    """Every episode of a dataset as Minari reads it, infos flattened (``info.*``)."""
    out = []
    for ep in minari.load_dataset(dataset_id).iterate_episodes():
        names = ("observations", "actions", "rewards", "terminations", "truncations")
        arrays = {k: np.asarray(getattr(ep, k)) for k in names}
        out.append({**arrays, **{f"info.{k}": np.asarray(v) for k, v in ep.infos.items()}})
    return out


@pytest.mark.parametrize("fmt", ["hdf5", "arrow"])
def test_a_parallel_export_writes_the_serial_dataset_bit_for_bit(tmp_path: Path, fmt: str) -> None:
    _save_run(tmp_path / "ck", num_shards=3)  # 3 shards, 2 processes: one waits for a free slot
    serial = export_checkpoint(tmp_path / "ck", "sr/serial-v0", **SPACES, data_format=fmt, partial="drop")
    parallel = export_checkpoint(tmp_path / "ck", "sr/parallel-v0", **SPACES, data_format=fmt, partial="drop",
                                 jobs=2)
    for key in ("episodes", "steps", "counts"):
        assert serial[key] == parallel[key], key
    assert serial["counts"]["dropped_episodes"] > 0
    ours, theirs = _episodes("sr/serial-v0"), _episodes("sr/parallel-v0")
    assert len(ours) == len(theirs) == serial["episodes"]
    for a, b in zip(ours, theirs, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name
    meta = minari.load_dataset("sr/parallel-v0").storage
    assert meta.total_steps == serial["steps"] and meta.total_episodes == serial["episodes"]
    assert next(iter(meta.get_episode_metadata([3])))["total_steps"] == len(theirs[3]["rewards"])


def test_a_failed_shard_fails_the_parallel_export_and_leaves_nothing(tmp_path: Path) -> None:
    _save_run(tmp_path / "ck")

    def origin(shard: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # runs in each shard's process
        if shard == 1:
            raise OSError(28, "No space left on device")
        return np.zeros_like(rows), rows

    with pytest.raises(ShardReplayError, match=r"shard 1 failed: OSError: \[Errno 28\] No space left"):
        export_checkpoint(tmp_path / "ck", "sr/failed-v0", **SPACES, origin=origin, jobs=2)
    assert not minari.storage.get_dataset_path("sr/failed-v0").exists()
    assert not list(minari.storage.get_dataset_path("sr/failed-v0").parent.glob(".failed-v0*"))


@pytest.mark.slow  # about 6 CPU-s: torchrl's import
def test_torchrl_samples_the_export(tmp_path: Path, datasets: Path) -> None:
    pytest.importorskip("torchrl")
    from torchrl.data.datasets.minari_data import MinariExperienceReplay

    _save_run(tmp_path / "ck")
    for jobs in (1, 2):  # the parallel one's main file links to each shard's file
        summary = export_checkpoint(tmp_path / "ck", f"sr/torchrl{jobs}-v0", **SPACES, data_format="hdf5",
                                    jobs=jobs)
        data = MinariExperienceReplay(f"sr/torchrl{jobs}-v0", batch_size=32, root=tmp_path / "torchrl",
                                      load_from_local_minari=True, download=True)
        batch = data.sample()
        assert len(data) == summary["steps"]  # every transition, N + 1 observations read as obs/next obs
        assert batch["observation"].shape == (32, 3) and batch["next", "observation"].shape == (32, 3)
        assert batch["action"].shape == (32,) and batch["next", "reward"].shape == (32, 1)
        assert int(batch["episode"].max()) < summary["episodes"]
    # Not checked: the values. torchrl 0.14.1 fills its tensordict, then replaces it by
    # `memmap_like` of it (contentless), so every value it samples is 0; the same for a
    # dataset Minari's create_dataset_from_buffers wrote (checked by hand, docs/offline.md).


def test_an_existing_id_or_a_bad_format_is_refused(tmp_path: Path) -> None:
    _save_run(tmp_path / "ck")
    export_checkpoint(tmp_path / "ck", "sr/twice-v0", **SPACES)
    with pytest.raises(ConfigError, match="exists already"):
        export_checkpoint(tmp_path / "ck", "sr/twice-v0", **SPACES)
    with pytest.raises(ConfigError, match="hdf5 or arrow"):
        export_checkpoint(tmp_path / "ck", "sr/other-v0", **SPACES, data_format="csv")
    assert not minari.storage.get_dataset_path("sr/other-v0").exists()


@pytest.mark.parametrize(("fmt", "jpeg"), [("hdf5", False), ("arrow", False), ("hdf5", True)])
def test_prefill_reads_what_minaris_own_writer_wrote(fmt: str, jpeg: bool) -> None:
    """Our reader of Minari's files (lossless Box/Discrete) gives the buffer the episodes
    as written, Minari's (JPEG images) as it decodes them; priorities from the infos."""
    from minari.data_collector import EpisodeBuffer

    rng = np.random.default_rng(5)
    shape, dtype = ((32, 32), np.uint8) if jpeg else ((3,), np.float32)
    space = gym.spaces.Box(0, 255, shape, np.uint8) if jpeg else SPACES["observation_space"]
    eps = []
    for t in (5, 1, 9):
        obs = rng.integers(0, 256, (t + 1, *shape)).astype(dtype)
        done = np.arange(t) == t - 1
        eps.append(EpisodeBuffer(observations=obs, actions=rng.integers(0, 4, t), rewards=rng.random(t),
                                 terminations=done & (t != 9), truncations=done & (t == 9),
                                 infos={"priority": rng.random(t + 1).astype(np.float32) + 0.5}))
    about = dict.fromkeys(["algorithm_name", "author", "author_email", "code_permalink", "description"], "t")
    minari.create_dataset_from_buffers("sr/theirs-v0", eps, observation_space=space,
                                       action_space=SPACES["action_space"], **about, data_format=fmt,
                                       jpeg_encoding=jpeg)
    spec = sr.Spec({"obs": sr.Field(shape, dtype), "action": sr.Field((), np.int64),
                    "reward": sr.Field((), np.float32)})
    buf = sr.ReplayBuffer(spec, num_streams=1, stream_capacity=64, sampler="prioritized")
    assert prefill(buf, "sr/theirs-v0") == {"episodes": 3, "steps": 6 + 2 + 10}
    steps = _steps(buf)
    read = eps  # as written; JPEG images as Minari decodes them (its reader fails on arrow's 1-D infos)
    if jpeg:
        read = list(minari.load_dataset("sr/theirs-v0").iterate_episodes())
    want = {"field.obs": np.concatenate([ep.observations for ep in read]),
            "field.action": np.concatenate([np.append(ep.actions, 0) for ep in read]),
            "field.reward": np.concatenate([np.append(ep.rewards, 0) for ep in read]).astype(np.float32),
            "discount": np.concatenate([np.append(np.ones(len(ep.rewards)), 1.0 - ep.terminations[-1])
                                        for ep in read]).astype(np.float32),
            "priority": np.concatenate([np.asarray(ep.infos["priority"]).reshape(-1) for ep in read])}
    for name, values in want.items():
        assert steps[name].tobytes() == values.astype(steps[name].dtype).tobytes(), name
    assert jpeg == (steps["field.obs"].tobytes() != np.concatenate([e.observations for e in eps]).tobytes())


@pytest.mark.slow  # about 5 CPU-s: a child that imports the package and minari
def test_a_killed_export_leaves_no_dataset(tmp_path: Path, datasets: Path) -> None:
    _save_run(tmp_path / "ck")
    code = textwrap.dedent(f"""
        import sys, time, numpy as np, gymnasium as gym
        from shardreplay.offline import CheckpointEpisodes, write_dataset
        def slow():
            for i, ep in enumerate(CheckpointEpisodes({str(tmp_path / "ck")!r})):
                if i == 5:
                    print("writing", flush=True)
                    time.sleep(60)
                yield ep
        box = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
        write_dataset(slow(), "sr/killed-v0", observation_space=box, action_space=gym.spaces.Discrete(4))
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=os.environ)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        leftovers = list((datasets / "sr").glob(".killed-v0.partial-*"))
        assert leftovers and any(leftovers[0].rglob("*.hdf5"))  # episodes were being written
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert not minari.storage.get_dataset_path("sr/killed-v0").exists()
    assert "sr/killed-v0" not in minari.list_local_datasets()
    with pytest.raises(FileNotFoundError):
        minari.load_dataset("sr/killed-v0")
    # The next export of the id writes it and removes the dead one's leftovers.
    export_checkpoint(tmp_path / "ck", "sr/killed-v0", **SPACES)
    assert minari.load_dataset("sr/killed-v0").total_episodes > 0
    assert not list((datasets / "sr").glob(".killed-v0.partial-*"))


@pytest.mark.slow  # about 5 CPU-s each: a child that imports the package and minari
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_a_killed_or_interrupted_parallel_export_leaves_no_dataset_and_no_process(
        tmp_path: Path, datasets: Path, sig: signal.Signals) -> None:
    _save_run(tmp_path / "ck")
    code = textwrap.dedent(f"""
        import os, time, numpy as np, gymnasium as gym
        from shardreplay.offline import export_checkpoint
        def origin(shard, rows):  # runs in each shard's process, before its episodes are written
            print("writing", os.getpid(), flush=True)
            time.sleep(60)
        box = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
        export_checkpoint({str(tmp_path / "ck")!r}, "sr/killed-v0", observation_space=box,
                          action_space=gym.spaces.Discrete(4), origin=origin, jobs=2)
    """)

    def ctrl_c_acts() -> None:  # as in a terminal: SIGINT's default action, a process group of its own
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.setsid()

    errors = tmp_path / "stderr.txt"  # a file, not a pipe: nobody reads it while the child runs
    with open(errors, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err, text=True,
                                env=os.environ, preexec_fn=ctrl_c_acts)
    try:
        assert proc.stdout is not None
        children: list[int] = []
        others: list[str] = []
        for line in proc.stdout:  # other lines (a library's notices) are not the writers'
            if line.startswith("writing "):
                children.append(int(line.split()[1]))
            else:
                others.append(line)
            if len(children) == 2:
                break
        assert len(children) == 2, (
            f"the export ended before both writers started; other stdout {''.join(others)[-2000:]!r}; "
            f"stderr:\n{errors.read_text()[-3000:]}")
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # Ctrl-C reaches the whole group
        else:
            proc.send_signal(sig)  # the exporting process alone: its children must follow
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in children)  # SIGKILL: PR_SET_PDEATHSIG; SIGINT: killed, joined
    assert not minari.storage.get_dataset_path("sr/killed-v0").exists()
    assert "sr/killed-v0" not in minari.list_local_datasets()
    if sig == signal.SIGINT:  # the interrupted export removed its own temporary directory
        assert not list((datasets / "sr").glob(".killed-v0*"))


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_an_incremental_checkpoint_exports_as_its_full_twin(tmp_path: Path) -> None:
    """Its field rows live partly in the checkpoint before it (refs): read through them."""
    rng = np.random.default_rng(3)
    buf = sr.ReplayBuffer(SPEC, num_streams=ROWS, stream_capacity=CAP, sampler="prioritized", alpha=ALPHA)
    ctr = 0
    for checkpoint_id in (1, 2):
        for t in range(40):
            types = np.full(ROWS, FIRST if t % 8 == 0 else LAST if t % 8 == 7 else MID, np.uint8)
            buf.add({"obs": np.stack([np.full(3, ctr + i, np.float32) for i in range(ROWS)]),
                     "action": rng.integers(0, 4, ROWS), "reward": rng.random(ROWS).astype(np.float32),
                     "step_type": types}, priorities=rng.random(ROWS) + 0.1)
            ctr += ROWS
        checkpoint.save(as_shard(buf, 0, 1), tmp_path / "inc", checkpoint_id, incremental=True)
    checkpoint.save(as_shard(buf, 0, 1), tmp_path / "full", 2)
    from shardreplay.checkpoint.manifest import checkpoint_dir, load_manifest

    assert load_manifest(checkpoint_dir(tmp_path / "inc", 2)).parts[0].refs  # rows in checkpoint 1's file
    export_checkpoint(tmp_path / "inc", "sr/inc-v0", **SPACES)
    export_checkpoint(tmp_path / "full", "sr/full-v0", **SPACES)
    ours, theirs = _episodes("sr/inc-v0"), _episodes("sr/full-v0")
    assert len(ours) == len(theirs) > 5
    for a, b in zip(ours, theirs, strict=True):
        for name in a:
            assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name


def test_a_flipped_byte_in_a_field_stops_the_export_naming_file_and_block(tmp_path: Path) -> None:
    """The rows go to the writer from the memory-mapped part: every block is checked
    first (with that check skipped, this export succeeds with the flipped row)."""
    from shardreplay.checkpoint.format import BLOCK_BYTES, PartReader
    from shardreplay.checkpoint.manifest import checkpoint_dir, load_manifest
    from shardreplay.errors import CheckpointDamagedError

    spec = sr.Spec({"obs": sr.Field((1024,), np.float32), "action": sr.Field((), np.int64),
                    "reward": sr.Field((), np.float32)})
    buf = sr.ReplayBuffer(spec, num_streams=2, stream_capacity=400)
    types = np.tile(np.array([FIRST, *[MID] * 8, LAST], np.uint8), 40)
    buf.extend({"obs": np.ones((2, 400, 1024), np.float32), "action": np.zeros((2, 400), np.int64),
                "reward": np.zeros((2, 400), np.float32), "step_type": np.stack([types, types])})
    checkpoint.save(as_shard(buf, 0, 1), tmp_path / "ck", 1)  # 3.3 MB: field.obs fills whole blocks
    manifest = load_manifest(checkpoint_dir(tmp_path / "ck", 1))
    path = manifest.directory / manifest.parts[0].file
    with PartReader(path, manifest.parts[0]) as reader:
        begin, end = (reader.data_start + x for x in reader.header["field.obs"]["data_offsets"])
    block = -(-begin // BLOCK_BYTES)  # the first block wholly inside the obs rows
    assert (block + 1) * BLOCK_BYTES <= end
    data = bytearray(path.read_bytes())
    data[block * BLOCK_BYTES + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    box = gym.spaces.Box(-np.inf, np.inf, (1024,), np.float32)
    with pytest.raises(CheckpointDamagedError, match=rf"{path.name}: checksum mismatch in block {block}"):
        export_checkpoint(tmp_path / "ck", "sr/flipped-v0", observation_space=box,
                          action_space=SPACES["action_space"])
    assert not minari.storage.get_dataset_path("sr/flipped-v0").exists()
