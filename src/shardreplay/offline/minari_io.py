"""Export a sharded checkpoint to Minari, and prefill replay from a Minari dataset.

Our stored episode of ``K`` steps (dm_env order: step ``t`` holds ``obs_t``, the
``action_t`` taken at it and the ``reward_t`` that followed; the LAST step's action and
reward are padding) is Minari's episode of ``T = K - 1`` transitions: the ``K``
observations (Minari's N + 1), the first ``K - 1`` actions and rewards, and the LAST
step's discount as ``terminations[-1]`` (0) or ``truncations[-1]`` (1). The step infos
carry ``K`` entries each (one per observation, as Minari's own collector records):
``priority`` (float32), ``policy_version``, ``actor`` and ``stream`` (int64; -1 where
the source does not know it). Images are written raw (``jpeg_encoding=False``), so a
frame stack comes back bit for bit; ``unstack=True`` keeps only each stack's newest
frame. docs/offline.md has the table.

A dataset is written under a hidden temporary directory beside its final place and
renamed there at the end: an export that fails or is killed leaves nothing under the
id (Minari's listing skips hidden directories; the next export of that id removes the
leftovers of dead exports).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.checkpoint.episodes import apply_partial_policy
from shardreplay.checkpoint.loading import load_shard
from shardreplay.checkpoint.manifest import checkpoint_dir, latest_complete, load_manifest
from shardreplay.checkpoint.plan import NewLayout
from shardreplay.checkpoint.records import PartMeta
from shardreplay.checkpoint.refs import open_part
from shardreplay.checkpoint.saving import shard_of
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.errors import ConfigError, IncompleteCheckpointError
from shardreplay.spec import StepType

__all__ = ["ChunkEpisodes", "Episode", "episodes_of_checkpoint", "export_checkpoint", "prefill",
           "write_dataset"]

FIRST, MID, LAST = int(StepType.FIRST), int(StepType.MID), int(StepType.LAST)
INFO_KEYS = ("priority", "policy_version", "actor", "stream")
FIELDS = ("obs", "action", "reward")  # the fields a run's transition spec has
BATCH = 64  # episodes per write call of Minari's storage (HDF5 opens its file per call)

# (shard, rows) -> (actor ids, stream ids) of those saved rows.
Origin = Callable[[int, np.ndarray], tuple[np.ndarray, np.ndarray]]


def _minari() -> Any:
    try:
        import minari
    except ImportError as exc:
        raise ConfigError("Minari datasets need the minari extra: pip install 'shardreplay[minari]'") from exc
    return minari


@dataclass(frozen=True)
class Episode:
    """One stored episode of ``K >= 2`` steps: ``obs`` ``[K, ...]``, ``action``
    ``[K, ...]`` and ``reward`` ``[K]`` (the LAST step's action and reward are padding),
    ``terminated`` (else truncated), per-step ``priority`` ``[K]`` (None: none known)
    and ``policy_version`` ``[K]``, and the ``actor`` and ``stream`` that made it
    (-1: not known)."""

    obs: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    terminated: bool
    priority: np.ndarray | None
    policy_version: np.ndarray
    actor: int = -1
    stream: int = -1


@dataclass
class CheckpointEpisodes:
    """The episodes of a checkpoint's parts, read one part at a time when iterated;
    ``counts`` holds, once iterated, the steps and episodes read and the partial
    episodes sealed or dropped (``checkpoint/episodes.py``'s counts) plus the
    one-step episodes left out (``short_*``: no transition to export)."""

    root: Path
    checkpoint_id: int | None = None
    partial: str = "seal"
    origin: Origin | None = None
    counts: dict[str, int] = field(default_factory=dict)

    def __iter__(self) -> Iterator[Episode]:
        for shard, arrays, exact in _shard_states(self.root, self.checkpoint_id):
            out, eps, report = apply_partial_policy(arrays, self.partial)
            for key, value in report.items():
                self.counts[key] = self.counts.get(key, 0) + value
            self.counts["saved_steps"] = self.counts.get("saved_steps", 0) + int(arrays["row_length"].sum())
            actor = stream = np.full(eps.row.shape[0], -1, np.int64)
            if self.origin is not None and exact:
                actor, stream = self.origin(shard, eps.row)
            obs, action, reward = (out[f"field.{name}"] for name in FIELDS)
            for k, (s, n) in enumerate(zip(eps.start.tolist(), eps.length.tolist(), strict=True)):
                if n < 2:
                    self.counts["short_episodes"] = self.counts.get("short_episodes", 0) + 1
                    self.counts["short_steps"] = self.counts.get("short_steps", 0) + n
                    continue
                e = slice(s, s + n)
                yield Episode(obs[e], action[e], reward[e], bool(out["discount"][s + n - 1] == 0),
                              out["priority"][e], np.full(n, -1, np.int64), int(actor[k]), int(stream[k]))


@dataclass
class ChunkEpisodes:
    """Episodes reassembled from actor chunks (``actor_id``, ``stream_ids`` ``[S]``,
    ``steps`` ``{field: [S, T, ...]}`` with ``step_type`` and ``discount``, ``priorities``
    ``[S, T]`` or None, ``policy_version``), as ``train --keep-rollouts`` keeps them:
    consecutive chunks of one (actor, stream) continue each other. An episode is yielded
    at its LAST; one without its FIRST (the archive's cap dropped its head) or its LAST
    (the run stopped in it) is partial: sealed (a truncation) or dropped by ``partial``,
    and counted in ``counts`` as :class:`CheckpointEpisodes` counts."""

    chunks: Iterable[Any]
    partial: str = "seal"
    counts: dict[str, int] = field(default_factory=dict)

    def __iter__(self) -> Iterator[Episode]:
        if self.partial not in ("seal", "drop"):
            raise ConfigError(f"partial must be seal or drop, got {self.partial!r}")
        pending: dict[tuple[int, int], list[tuple[dict[str, np.ndarray], int]]] = {}
        for chunk in self.chunks:
            types_all = chunk.steps["step_type"]
            prios = chunk.priorities
            self._count("saved_steps", int(types_all.size))
            for i, stream in enumerate(np.asarray(chunk.stream_ids).tolist()):
                key, types = (int(chunk.actor_id), int(stream)), types_all[i]
                lo = 0
                for hi in [*(np.flatnonzero(types == LAST) + 1).tolist(), types.shape[0]]:
                    if hi <= lo:
                        continue
                    piece = {name: chunk.steps[name][i, lo:hi] for name in (*FIELDS, "step_type", "discount")}
                    if prios is not None:
                        piece["priority"] = prios[i, lo:hi]
                    if types[lo] == FIRST and key in pending:  # the one before never ended
                        yield from self._close(key, pending.pop(key))
                    pending.setdefault(key, []).append((piece, int(chunk.policy_version)))
                    if types[hi - 1] == LAST:
                        yield from self._close(key, pending.pop(key))
                    lo = hi
        for key, pieces in pending.items():
            yield from self._close(key, pieces)

    def _count(self, name: str, value: int) -> None:
        self.counts[name] = self.counts.get(name, 0) + value

    def _close(self, key: tuple[int, int], pieces: list[tuple[dict[str, np.ndarray], int]]
               ) -> Iterator[Episode]:
        ep = {name: np.concatenate([p[name] for p, _v in pieces]) for name in pieces[0][0]}
        if any(("priority" in p) != ("priority" in pieces[0][0]) for p, _v in pieces):
            ep.pop("priority", None)
        n = ep["step_type"].shape[0]
        ended = ep["step_type"][-1] == LAST
        if ep["step_type"][0] != FIRST or not ended:
            self._count("partial_episodes", 1)
            self._count("partial_steps", n)
            verb = "sealed" if self.partial == "seal" else "dropped"
            self._count(f"{verb}_episodes", 1)
            self._count(f"{verb}_steps", n)
            if self.partial == "drop":
                return
        if n < 2:
            self._count("short_episodes", 1)
            self._count("short_steps", n)
            return
        version = np.concatenate([np.full(p["step_type"].shape[0], v, np.int64) for p, v in pieces])
        yield Episode(ep["obs"], ep["action"], ep["reward"], bool(ended and ep["discount"][-1] == 0),
                      ep.get("priority"), version, key[0], key[1])


def episodes_of_checkpoint(root: str | Path, checkpoint_id: int | None = None, *, partial: str = "seal",
                           origin: Origin | None = None) -> CheckpointEpisodes:
    """The episodes of checkpoint ``checkpoint_id`` (None: the newest complete one) under
    ``root``, shard after shard, each part read as saved (rows, priorities, frame
    stacks). ``partial`` (``seal`` or ``drop``) is applied to the episodes a part holds
    only in part (still running, or cut by the ring); ``origin`` names the actor and
    stream of each saved row (None: -1).

    Raises (when iterated):
        IncompleteCheckpointError: no complete checkpoint under ``root``.
        CheckpointError: a damaged part.
        ConfigError: a spec without the ``obs``, ``action`` and ``reward`` fields, or
            parts too old to say their layout.
    """
    return CheckpointEpisodes(Path(root), checkpoint_id, partial, origin)


def _shard_states(root: Path, checkpoint_id: int | None) -> Iterator[tuple[int, dict[str, np.ndarray], bool]]:
    """(shard, exported step arrays, restored exactly as saved) for each part."""
    cid = latest_complete(root) if checkpoint_id is None else checkpoint_id
    if cid is None:
        raise IncompleteCheckpointError(f"no complete checkpoint under {root}: train with checkpoints on "
                                        "(the run's --checkpoint-* flags) first")
    directory = checkpoint_dir(root, cid)
    manifest = load_manifest(directory)
    missing = [name for name in FIELDS if name not in manifest.spec.fields]
    if missing:
        raise ConfigError(f"{directory}: the spec {manifest.spec} lacks {missing}; the Minari export "
                          f"takes the fields {FIELDS} of a run's transitions")
    metas = []
    for part in manifest.parts:
        with open_part(directory, part) as reader:
            metas.append(PartMeta.parse(reader.metadata.get("buffer_meta", "{}"), reader.path))
    if any(m.num_streams is None or m.stream_capacity is None for m in metas):
        raise ConfigError(f"{directory}: parts written before their layout was recorded; load the "
                          "checkpoint into a ReplayBuffer and save it again")
    layout = NewLayout(tuple(int(m.num_streams or 0) for m in metas), tuple(int(m.stream_capacity or 0)
                                                                             for m in metas))
    for k, meta in enumerate(metas):
        local = ReplayBuffer(manifest.spec, num_streams=layout.num_streams[k],
                             stream_capacity=layout.stream_capacity[k], window=max(2, meta.period),
                             sampler="prioritized", period=meta.period)
        report = load_shard(directory, local, k, len(metas), layout=layout)
        arrays = {name: value.numpy() for name, value in local.state_dict()["arrays"].items()}
        yield k, arrays, report.exact


def export_checkpoint(root: str | Path, dataset_id: str, *, observation_space: Any, action_space: Any,
                      env_spec: Any = None, checkpoint_id: int | None = None, partial: str = "seal",
                      origin: Origin | None = None, data_format: str = "hdf5", unstack: bool = False,
                      metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write a checkpoint's episodes (:func:`episodes_of_checkpoint`) as the Minari
    dataset ``dataset_id`` (:func:`write_dataset`); returns its summary.

    Raises:
        As :func:`episodes_of_checkpoint` and :func:`write_dataset`.
    """
    episodes = episodes_of_checkpoint(root, checkpoint_id, partial=partial, origin=origin)
    return write_dataset(episodes, dataset_id, observation_space=observation_space, action_space=action_space,
                         env_spec=env_spec, data_format=data_format, unstack=unstack,
                         metadata=metadata, counts=episodes.counts)


def write_dataset(episodes: Iterable[Episode], dataset_id: str, *, observation_space: Any, action_space: Any,
                  env_spec: Any = None, data_format: str = "hdf5", unstack: bool = False,
                  metadata: dict[str, Any] | None = None, counts: dict[str, int] | None = None
                  ) -> dict[str, Any]:
    """Write ``episodes`` as the Minari dataset ``dataset_id`` (under
    ``MINARI_DATASETS_PATH``, else ``~/.minari/datasets``), lossless, in ``data_format``
    (``hdf5``: what TorchRL's ``MinariExperienceReplay`` reads; or ``arrow``).
    ``metadata`` and ``counts`` (filled while ``episodes`` is iterated) go into the
    dataset's metadata under ``shardreplay``. Returns the summary (id, path, episodes,
    steps, bytes, counts).

    Raises:
        ConfigError: the minari extra is missing, the id exists already, an unknown
            format, ``unstack`` on observations that are not stacks; nothing is left
            under the id then, nor after any other error.
    """
    minari = _minari()
    from minari.data_collector import EpisodeBuffer
    from minari.dataset.minari_storage import MinariStorage
    from minari.namespace import create_namespace, list_local_namespaces
    from minari.storage.datasets_root_dir import get_dataset_path
    from minari.utils import parse_dataset_id

    fmt = {"hdf5": "hdf5", "arrow": "arrow"}.get(data_format)
    if fmt is None:
        raise ConfigError(f"--format must be hdf5 or arrow, got {data_format!r}")
    final = Path(get_dataset_path(dataset_id))
    if final.exists():
        raise ConfigError(f"a Minari dataset {dataset_id!r} exists already at {final}: choose another id "
                          "(or version), or delete it")
    if unstack:
        observation_space = _frame_space(observation_space)
    namespace = parse_dataset_id(dataset_id)[0]
    if namespace is not None and namespace not in list_local_namespaces():
        create_namespace(namespace)  # as Minari's own writers do: its listing reads the namespace's metadata
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_leftovers(final)
    tmp = final.parent / f".{final.name}.partial-{os.getpid()}"
    counts = {} if counts is None else counts
    try:
        tmp.mkdir()
        storage = MinariStorage.new(tmp / "data", observation_space=observation_space,
                                    action_space=action_space, env_spec=env_spec, data_format=fmt,
                                    jpeg_encoding=False)
        storage.update_metadata({"dataset_id": dataset_id, "minari_version": minari.__version__})
        lists = fmt == "arrow"  # Minari's Arrow infos take 1-d columns as lists only
        batch: list[Any] = []
        for n_eps, ep in enumerate(episodes):
            obs = ep.obs[:, -1] if unstack else ep.obs
            t = ep.obs.shape[0] - 1
            done = np.zeros(t, np.bool_)
            done[-1] = True
            infos = {"policy_version": ep.policy_version, "actor": np.full(t + 1, ep.actor, np.int64),
                     "stream": np.full(t + 1, ep.stream, np.int64)}
            if ep.priority is not None:  # none known: none written (an import gives the max)
                infos["priority"] = ep.priority
            if lists:
                infos = {k: v.tolist() for k, v in infos.items()}
            batch.append(EpisodeBuffer(id=n_eps, observations=obs, actions=ep.action[:t],
                                       rewards=ep.reward[:t], terminations=done & ep.terminated,
                                       truncations=done & (not ep.terminated), infos=infos))
            if len(batch) == BATCH:
                storage.update_episodes(batch)
                batch = []
        if batch:
            storage.update_episodes(batch)
        summary = {"dataset_id": dataset_id, "format": fmt, "episodes": storage.total_episodes,
                   "steps": storage.total_steps, "unstacked": unstack, "counts": dict(counts)}
        storage.update_metadata({"shardreplay": {**(metadata or {}), **summary}})
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary["path"] = str(final)
    summary["bytes"] = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
    return summary


def _frame_space(space: Any) -> Any:
    """The Box of one frame of a Box of frame stacks (its first axis)."""
    import gymnasium as gym

    if not isinstance(space, gym.spaces.Box) or len(space.shape) < 3:
        raise ConfigError(f"--unstack takes frame-stacked observations [stack, *frame], got {space}")
    return gym.spaces.Box(space.low[-1], space.high[-1], space.shape[1:], space.dtype)


def _remove_dead_leftovers(final: Path) -> None:
    """Remove the temporary directories of exports of ``final`` whose process is gone."""
    pattern = re.compile(rf"^\.{re.escape(final.name)}\.partial-(\d+)$")
    for path in final.parent.iterdir():
        match = pattern.match(path.name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass  # alive, someone else's


def prefill(buffer: ReplayBuffer | ShardedReplayBuffer, dataset_id: str) -> dict[str, int]:
    """Stream the Minari dataset ``dataset_id`` into ``buffer`` (a fresh ReplayBuffer, or
    this rank's ShardedReplayBuffer: every rank calls it, no collective). Episodes are
    dealt whole, each to the shard and then the stream that holds the fewest steps so
    far (the same deal on every rank; a rank reads only its own episodes). Each step
    gets the priority of the dataset's ``priority`` info where it has one, else the
    buffer's largest. Returns this rank's ``{episodes, steps}``.

    Raises:
        ConfigError: the minari extra is missing, no such dataset, or a dataset whose
            observations or actions do not fit the buffer's ``obs``/``action`` fields.
    """
    minari = _minari()
    local, shard, num_shards = shard_of(buffer)
    missing = [name for name in FIELDS if name not in local.spec.fields]
    if missing:
        raise ConfigError(f"prefill writes the fields {FIELDS}; the buffer's spec lacks {missing}")
    from minari.dataset.minari_storage import MinariStorage
    from minari.storage.datasets_root_dir import get_dataset_path

    path = Path(get_dataset_path(dataset_id)) / "data"
    if not path.is_dir():
        raise ConfigError(f"no Minari dataset {dataset_id!r} at {path.parent}: export one ("
                          "shardreplay export RUN --minari ID) or set MINARI_DATASETS_PATH")
    store = MinariStorage.read(path)
    episode_ids = list(range(store.total_episodes))
    lengths = [int(m["total_steps"]) + 1 for m in store.get_episode_metadata(episode_ids)]
    dataset = minari.MinariDataset(store)
    mine = _deal(np.asarray(lengths, np.int64), num_shards)
    rows = np.zeros(local.num_streams, np.int64)  # steps dealt to each row so far
    lock = buffer.write_lock if isinstance(buffer, ShardedReplayBuffer) else contextlib.nullcontext()
    stored = steps = 0
    indices = [i for i, s in zip(episode_ids, mine.tolist(), strict=True) if s == shard]
    spec = local.spec
    for ep in dataset.iterate_episodes(indices):
        k = len(ep.rewards) + 1
        if k < 2:
            continue
        step = {"obs": np.asarray(ep.observations), "action": _padded(np.asarray(ep.actions), spec["action"]),
                "reward": _padded(np.asarray(ep.rewards), spec["reward"]),
                "step_type": np.full(k, MID, np.uint8), "discount": np.ones(k, np.float32)}
        if step["obs"].shape[1:] != spec["obs"].shape:
            raise ConfigError(f"dataset {dataset_id!r}: observations {step['obs'].shape[1:]}, the buffer's "
                              f"obs field {spec['obs'].shape} (an --unstack export needs a spec of "
                              "single frames)")
        step["step_type"][0], step["step_type"][-1] = FIRST, LAST
        step["discount"][-1] = 0.0 if bool(np.asarray(ep.terminations)[-1]) else 1.0
        info = ep.infos.get("priority") if isinstance(ep.infos, dict) else None
        prio = None if info is None else np.asarray(info, np.float32).reshape(-1)[:k]
        row = int(np.argmin(rows))
        rows[row] += k
        cap = local.stream_capacity
        with lock:
            for lo in range(0, k, cap):  # longer than a row: the ring keeps its newest steps
                piece = {name: v[None, lo:lo + cap] for name, v in step.items()}
                local.extend(piece, [row], None if prio is None else prio[None, lo:lo + cap])
        stored += 1
        steps += k
    return {"episodes": stored, "steps": steps}


def _deal(lengths: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard of each episode: the one with the fewest steps so far, in order."""
    totals = np.zeros(num_shards, np.int64)
    out = np.empty(lengths.shape[0], np.int64)
    for i, n in enumerate(lengths.tolist()):
        out[i] = s = int(np.argmin(totals))
        totals[s] += n
    return out


def _padded(values: np.ndarray, spec_field: Any) -> np.ndarray:
    """``values`` of the ``K - 1`` transitions plus the LAST step's padding (zeros)."""
    out = np.zeros((values.shape[0] + 1, *spec_field.shape), spec_field.dtype)
    out[:-1] = values.reshape(out[:-1].shape)
    return out
