"""Export a sharded checkpoint to Minari, and prefill replay from a Minari dataset.

docs/offline.md has the conventions (a stored episode of ``K`` steps is Minari's episode
of ``K - 1`` transitions), the files written and how a failed export leaves nothing.
"""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import multiprocessing as mp
import os
import re
import shutil
import signal
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import numpy as np

from shardreplay._signals import die_with_parent
from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.checkpoint.episodes import find_episodes
from shardreplay.checkpoint.format import PartReader
from shardreplay.checkpoint.manifest import Manifest, checkpoint_dir, latest_complete, load_manifest
from shardreplay.checkpoint.refs import ChainedReader, open_part, saved_seals
from shardreplay.checkpoint.saving import shard_of
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.errors import ConfigError, IncompleteCheckpointError, ShardReplayError
from shardreplay.spec.fields import VERSION_FIELD, StepType
from shardreplay.transport.local import pid_alive

__all__ = ["CheckpointEpisodes", "ChunkEpisodes", "Episode", "export_checkpoint", "prefill", "write_dataset"]

FIRST, MID, LAST = int(StepType.FIRST), int(StepType.MID), int(StepType.LAST)
FIELDS = ("obs", "action", "reward")  # the fields a run's transition spec has
COMPACT_BYTES = 16 << 10  # HDF5 keeps a dataset this small inside its group's header
FLUSH_BYTES = 1 << 20  # prefill writes a row's episodes together up to this many observation bytes

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
    """The episodes of checkpoint ``checkpoint_id`` (None: the newest complete one) under
    ``root``, shard after shard (``shards``: these only), each part read as saved, its
    partial episodes sealed or dropped by ``partial``; ``origin`` names the actor and
    stream of each saved row (None: -1); ``counts`` is filled as it is iterated
    (:func:`_count`).

    Raises (when iterated):
        IncompleteCheckpointError: no complete checkpoint under ``root``.
        CheckpointError: a damaged part (the block named).
        ConfigError: a spec without per-step ``obs``, ``action`` and ``reward`` fields.
    """

    root: str | Path
    checkpoint_id: int | None = None
    partial: str = "seal"
    origin: Origin | None = None
    counts: dict[str, int] = field(default_factory=dict)
    shards: Sequence[int] | None = None

    def __iter__(self) -> Iterator[Episode]:
        manifest = _manifest(Path(self.root), self.checkpoint_id)
        for shard in range(len(manifest.parts)) if self.shards is None else self.shards:
            with open_part(manifest.directory, manifest.parts[shard]) as reader:
                yield from self._part(reader, shard)

    def _part(self, reader: PartReader | ChainedReader, shard: int) -> Iterator[Episode]:
        steps = _step_arrays(reader)
        start, length, row, terminated = _cut(steps, self.partial, self.counts)
        actor, stream = self.origin(shard, row) if self.origin else (np.full(row.shape, -1),) * 2
        prio, version = steps.get("priority"), steps[f"field.{VERSION_FIELD}"]
        if not start.size:
            return
        mapped = _mapped(reader) if isinstance(reader, PartReader) else None  # else rows in older files
        for k, (lo, hi) in enumerate(zip(start.tolist(), (start + length).tolist(), strict=True)):
            obs, action, reward = (mapped[name][lo:hi] if mapped else reader.rows(f"field.{name}", lo, hi)
                                   for name in FIELDS)
            yield Episode(obs, action, reward, bool(terminated[k]), None if prio is None else prio[lo:hi],
                          version[lo:hi], int(actor[k]), int(stream[k]))


def _mapped(reader: PartReader) -> dict[str, np.ndarray]:
    """A full part's fields as read-only views of its memory-mapped file, every block of
    it hash-checked first: the rows are then written without a copy into this process."""
    reader.verify_all()
    with open(reader.path, "rb") as file:
        whole = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    out = {}
    for name in FIELDS:
        dtype, shape = reader.entry(f"field.{name}")
        begin = reader.data_start + int(reader.header[f"field.{name}"]["data_offsets"][0])
        out[name] = np.frombuffer(whole, dtype, int(np.prod(shape)), begin).reshape(shape)
    return out


def _manifest(root: Path, checkpoint_id: int | None) -> Manifest:
    """The manifest of checkpoint ``checkpoint_id`` (None: the newest with all its files;
    their blocks are hash-checked as the export reads them), checked for the fields."""
    if checkpoint_id is None:
        checkpoint_id = latest_complete(root, hashes=False)
    if checkpoint_id is None:
        raise IncompleteCheckpointError(f"no complete checkpoint under {root}: train with checkpoints on "
                                        "(the run's --checkpoint-* flags) first")
    manifest = load_manifest(checkpoint_dir(root, checkpoint_id))
    missing = [name for name in FIELDS if name not in manifest.spec or manifest.spec[name].at_starts]
    if missing:
        raise ConfigError(f"{manifest.directory}: the spec {manifest.spec} lacks per-step {missing}; the "
                          f"Minari export takes the per-step fields {FIELDS} of a run's transitions")
    return manifest


def _step_arrays(reader: PartReader | ChainedReader) -> dict[str, np.ndarray]:
    """A part's per-step arrays other than its fields, with the step types and
    discounts its save sealed put back (``seal.*``), as a restore puts them back, and
    the policy versions (-1 where it saved none)."""
    names = set(reader.names())
    wanted = ("step_type", "discount", "episode_id", "row_length", "priority", f"field.{VERSION_FIELD}")
    out: dict[str, np.ndarray] = {n: reader.array(n) for n in wanted if n in names}
    out.setdefault(f"field.{VERSION_FIELD}", np.full(out["step_type"].shape[0], -1, np.int64))
    index, types, discounts = saved_seals(reader, out["step_type"].shape[0])
    out["step_type"][index], out["discount"][index] = types, discounts
    return out


def _count(counts: dict[str, int], partial: str, saved: int, length: Any = (), cut: Any = (),
           unversioned: int = 0) -> np.ndarray:
    """Which episodes (of ``length`` steps; partial where ``cut``) are exported: not the
    partial ones ``partial="drop"`` drops, nor one-step ones (no transition). Adds them,
    the steps read (``saved``) and those without a policy version (exported as -1) to
    ``counts``."""
    if partial not in ("seal", "drop"):
        raise ConfigError(f"partial must be seal or drop, got {partial!r}")
    verb = "sealed" if partial == "seal" else "dropped"
    length, cut = np.asarray(length, np.int64), np.asarray(cut, np.bool_)
    dropped = cut & (partial == "drop")
    short = (length < 2) & ~dropped
    partial_steps = length[cut].sum()
    for name, value in {"saved_steps": saved, "partial_episodes": cut.sum(), "partial_steps": partial_steps,
                        f"{verb}_episodes": cut.sum(), f"{verb}_steps": partial_steps,
                        "short_episodes": short.sum(), "short_steps": length[short].sum(),
                        "unversioned_steps": unversioned}.items():
        counts[name] = counts.get(name, 0) + int(value)
    return ~short & ~dropped


def _cut(steps: dict[str, np.ndarray], partial: str, counts: dict[str, int]) -> tuple[np.ndarray, ...]:
    """The exported episodes of a part's steps (start, length, row, terminated; two
    steps or more), partial ones sealed (ended as truncations) or dropped; adds what
    it saw to ``counts``."""
    types, discount = steps["step_type"], steps["discount"]
    eps = find_episodes(types, steps["episode_id"], steps["row_length"])
    last = eps.start + eps.length - 1
    keep = _count(counts, partial, types.shape[0], eps.length, eps.partial,
                  int((steps[f"field.{VERSION_FIELD}"] < 0).sum()))
    return (eps.start[keep], eps.length[keep], eps.row[keep],
            ((types[last] == LAST) & (discount[last] == 0))[keep])


@dataclass
class ChunkEpisodes:
    """Episodes reassembled from actor chunks (:class:`~shardreplay.transport.codec.Chunk`),
    as ``train --keep-rollouts`` keeps them: consecutive chunks of one (actor, stream)
    continue each other. An episode is yielded at its LAST; one without its FIRST or its
    LAST is partial: sealed or dropped by ``partial``, and counted in ``counts`` as
    :class:`CheckpointEpisodes` counts."""

    chunks: Iterable[Any]
    partial: str = "seal"
    counts: dict[str, int] = field(default_factory=dict)

    def __iter__(self) -> Iterator[Episode]:
        pending: dict[tuple[int, int], list[dict[str, np.ndarray]]] = {}
        for chunk in self.chunks:
            types_all, prios = chunk.steps["step_type"], chunk.priorities
            _count(self.counts, self.partial, int(types_all.size))
            for i, stream in enumerate(np.asarray(chunk.stream_ids).tolist()):
                key, types = (int(chunk.actor_id), int(stream)), types_all[i]
                lo = 0
                for hi in [*(np.flatnonzero(types == LAST) + 1).tolist(), types.shape[0]]:
                    if hi <= lo:
                        continue
                    piece = {name: chunk.steps[name][i, lo:hi] for name in (*FIELDS, "step_type", "discount")}
                    piece[VERSION_FIELD] = np.full(hi - lo, chunk.policy_version, np.int64)
                    if prios is not None:
                        piece["priority"] = prios[i, lo:hi]
                    if types[lo] == FIRST and key in pending:  # the one before never ended
                        yield from self._close(key, pending.pop(key))
                    pending.setdefault(key, []).append(piece)
                    if types[hi - 1] == LAST:
                        yield from self._close(key, pending.pop(key))
                    lo = hi
        for key, pieces in pending.items():
            yield from self._close(key, pieces)

    def _close(self, key: tuple[int, int], pieces: list[dict[str, np.ndarray]]) -> Iterator[Episode]:
        shared = [name for name in pieces[0] if all(name in p for p in pieces)]  # priority: in all or none
        ep = {name: np.concatenate([p[name] for p in pieces]) for name in shared}
        ended = ep["step_type"][-1] == LAST
        cut = ep["step_type"][0] != FIRST or not ended
        if not _count(self.counts, self.partial, 0, [ep["step_type"].shape[0]], [cut])[0]:
            return
        yield Episode(ep["obs"], ep["action"], ep["reward"], bool(ended and ep["discount"][-1] == 0),
                      ep.get("priority"), ep[VERSION_FIELD], key[0], key[1])


def export_checkpoint(root: str | Path, dataset_id: str, *, checkpoint_id: int | None = None,
                      partial: str = "seal", origin: Origin | None = None, jobs: int = 1,
                      **options: Any) -> dict[str, Any]:
    """Write a checkpoint's episodes (:class:`CheckpointEpisodes`) as the Minari
    dataset ``dataset_id`` (:func:`write_dataset`, which takes ``options``); returns its
    summary. ``jobs > 1``: up to that many forked processes write a saved shard each, the
    same dataset (docs/offline.md, "Export").

    Raises:
        As :class:`CheckpointEpisodes` and :func:`write_dataset`; ShardReplayError:
            a shard's process failed (its error's text) or was killed.
    """
    episodes = CheckpointEpisodes(root, checkpoint_id, partial, origin)
    firsts = None
    if jobs > 1:
        manifest = _manifest(Path(root), checkpoint_id)
        episodes.checkpoint_id = manifest.checkpoint_id  # every process reads the same one
        firsts = [0]
        for part in manifest.parts:
            with open_part(manifest.directory, part) as reader:
                cut = _cut(_step_arrays(reader), partial, episodes.counts)
            firsts.append(firsts[-1] + cut[0].shape[0])
    return write_dataset(episodes, dataset_id, counts=episodes.counts,
                         parts=None if firsts is None else (firsts, jobs), **options)


def write_dataset(episodes: Iterable[Episode], dataset_id: str, *, observation_space: Any, action_space: Any,
                  env_spec: Any = None, data_format: str = "hdf5", unstack: bool = False,
                  metadata: dict[str, Any] | None = None, counts: dict[str, int] | None = None,
                  parts: tuple[list[int], int] | None = None) -> dict[str, Any]:
    """Write ``episodes`` as the Minari dataset ``dataset_id``, lossless, in ``data_format``
    (``hdf5`` or ``arrow``; the files and what maps to what: docs/offline.md, "Export").
    ``metadata`` and ``counts`` (filled while ``episodes`` is iterated) go into the
    dataset's metadata under ``shardreplay``. ``parts`` (a parallel
    :func:`export_checkpoint`): each shard's first episode id, and the processes to run.
    Returns the summary (id, path, episodes, steps, bytes, counts).

    Raises:
        ConfigError: the minari extra is missing, the id exists already, an unknown
            format, spaces other than Box and Discrete, ``unstack`` on observations
            that are not stacks; nothing is left under the id then, nor after any
            other error.
    """
    import gymnasium as gym

    minari = _minari()
    from minari.dataset.minari_storage import MinariStorage
    from minari.namespace import create_namespace, list_local_namespaces
    from minari.storage.datasets_root_dir import get_dataset_path
    from minari.utils import parse_dataset_id

    if data_format not in ("hdf5", "arrow"):
        raise ConfigError(f"--format must be hdf5 or arrow, got {data_format!r}")
    final = Path(get_dataset_path(dataset_id))
    if final.exists():
        raise ConfigError(f"a Minari dataset {dataset_id!r} exists already at {final}: choose another id "
                          "(or version), or delete it")
    if unstack:  # a Box of one frame of the Box of frame stacks (their first axis)
        box = observation_space
        if not isinstance(box, gym.spaces.Box) or len(box.shape) < 3:
            raise ConfigError(f"--unstack takes frame-stacked observations [stack, *frame], got {box}")
        observation_space = gym.spaces.Box(box.low[-1], box.high[-1], box.shape[1:], box.dtype)
    spaces = {"observations": observation_space, "actions": action_space}
    for space in spaces.values():
        if not isinstance(space, (gym.spaces.Box, gym.spaces.Discrete)):
            raise ConfigError(f"the Minari export writes Box and Discrete spaces, got {space}")
    namespace = parse_dataset_id(dataset_id)[0]
    if namespace is not None and namespace not in list_local_namespaces():
        create_namespace(namespace)  # as Minari's own writers do: its listing reads the namespace's metadata
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_leftovers(final)
    tmp = final.parent / f".{final.name}.partial-{os.getpid()}"
    counts = {} if counts is None else counts
    write = functools.partial(_write_episodes, tmp / "data", data_format, spaces, unstack)
    try:
        tmp.mkdir()
        # Minari's metadata file (spaces, env spec, format); the episodes are ours to write.
        storage = MinariStorage.new(tmp / "data", observation_space=observation_space,
                                    action_space=action_space, env_spec=env_spec, data_format=data_format,
                                    jpeg_encoding=False)
        if parts is None:
            total = write(episodes, 0, None)
        else:
            assert isinstance(episodes, CheckpointEpisodes)  # what export_checkpoint gives
            firsts, jobs = parts
            _run_forked([functools.partial(write, replace(episodes, counts={}, shards=[k]), firsts[k], k)
                         for k in range(len(firsts) - 1)], jobs)
            total = (firsts[-1], counts["saved_steps"] - counts.get("short_steps", 0)
                     - counts.get("dropped_steps", 0) - firsts[-1])
            if data_format == "hdf5":
                _link_parts(tmp / "data" / "main_data.hdf5", firsts)
        summary = {"dataset_id": dataset_id, "format": data_format, "episodes": total[0], "steps": total[1],
                   "unstacked": unstack, "counts": dict(counts)}
        storage.update_metadata({"dataset_id": dataset_id, "minari_version": minari.__version__,
                                 "total_episodes": total[0], "total_steps": total[1],
                                 "dataset_size": storage.get_size(),
                                 "shardreplay": {**(metadata or {}), **summary}})
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary["path"] = str(final)
    summary["bytes"] = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
    return summary


def _write_episodes(data: Path, fmt: str, spaces: dict[str, Any], unstack: bool, episodes: Iterable[Episode],
                    first: int, part: int | None) -> tuple[int, int]:
    """Write ``episodes`` as Minari's ``MinariStorage.update_episodes`` lays them out
    (JPEG off), ids from ``first``: HDF5 groups in ``data/main_data.hdf5`` (a parallel
    export's ``part``: in ``part-<part>.hdf5``), or Arrow's directory per episode.
    Returns (episodes, steps)."""
    n = steps = 0
    with contextlib.ExitStack() as stack:
        if fmt == "hdf5":
            import h5py

            name = "main_data.hdf5" if part is None else f"part-{part}.hdf5"
            file = stack.enter_context(h5py.File(data / name, "w", track_order=True))
        for n, ep in enumerate(episodes, 1):
            t = ep.obs.shape[0] - 1
            done = np.arange(t) == t - 1
            obs = ep.obs[:, -1] if unstack else ep.obs
            arrays = {"observations": np.asarray(obs, spaces["observations"].dtype),
                      "actions": np.asarray(ep.action[:t], spaces["actions"].dtype), "rewards": ep.reward[:t],
                      "terminations": done & ep.terminated, "truncations": done & (not ep.terminated)}
            infos = {"policy_version": ep.policy_version, "actor": np.full(t + 1, ep.actor, np.int64),
                     "stream": np.full(t + 1, ep.stream, np.int64)}
            if ep.priority is not None:  # none known: none written (an import gives the max)
                infos["priority"] = ep.priority
            if fmt == "hdf5":
                _hdf5_episode(file, first + n - 1, arrays, infos)
            else:
                _arrow_episode(data / str(first + n - 1), arrays, infos, spaces)
            steps += t
    return n, steps


_H5: dict[Any, Any] = {}  # h5py's dataset creation properties and types, made once


def _hdf5_episode(file: Any, i: int, arrays: dict[str, np.ndarray], infos: dict[str, np.ndarray]) -> None:
    """Episode ``i`` as Minari's HDF5 group, through h5py's low-level calls (a fraction
    of ``create_dataset``'s cost); datasets of at most ``COMPACT_BYTES`` kept in the
    group's header."""
    from h5py import h5d, h5g, h5p, h5s, h5t

    group = file.create_group(f"episode_{i}")
    group.attrs["id"], group.attrs["total_steps"] = i, arrays["rewards"].shape[0]
    info = h5g.create(group.id, b"infos")
    for where, name, values in [*((group.id, k, v) for k, v in arrays.items()),
                                *((info, k, v) for k, v in infos.items())]:
        values = np.ascontiguousarray(values)
        compact = values.nbytes <= COMPACT_BYTES
        if compact not in _H5:
            _H5[compact] = h5p.create(h5p.DATASET_CREATE)
            _H5[compact].set_layout(h5d.COMPACT if compact else h5d.CONTIGUOUS)
        if values.dtype not in _H5:
            _H5[values.dtype] = h5t.py_create(values.dtype, logical=True)
        h5d.create(where, name.encode(), _H5[values.dtype], h5s.create_simple(values.shape),
                   dcpl=_H5[compact]).write(h5s.ALL, h5s.ALL, values)


def _arrow_episode(directory: Path, arrays: dict[str, np.ndarray], infos: dict[str, np.ndarray],
                   spaces: dict[str, Any]) -> None:
    """Episode ``directory.name`` as Minari's Arrow directory: one record batch of the
    N + 1 steps (Box rows as fixed-size lists; actions, rewards, terminations and
    truncations padded with a zero row) and its ``metadata.json``."""
    import gymnasium as gym
    import pyarrow as pa

    columns = {}
    for name, values in arrays.items():
        if name != "observations":
            values = np.concatenate([values, np.zeros((1, *values.shape[1:]), values.dtype)])
        flat, space = pa.array(values.reshape(-1)), spaces.get(name)
        columns[name] = pa.FixedSizeListArray.from_arrays(flat, int(np.prod(space.shape))) \
            if isinstance(space, gym.spaces.Box) else flat
    columns["infos"] = pa.StructArray.from_arrays([pa.array(v) for v in infos.values()], names=list(infos))
    batch = pa.RecordBatch.from_pydict(columns)
    directory.mkdir()
    with pa.ipc.new_file(directory / "part-0.arrow", batch.schema) as out:
        out.write_batch(batch)
    (directory / "metadata.json").write_text(json.dumps({"id": int(directory.name),
                                                          "total_steps": arrays["rewards"].shape[0]}))


def _link_parts(main: Path, firsts: list[int]) -> None:
    """A parallel HDF5 export's main file: a link to each episode in its shard's file
    (HDF5 resolves them beside the main file, wherever the dataset is moved)."""
    import h5py

    with h5py.File(main, "w", track_order=True) as file:
        for k in range(len(firsts) - 1):
            for i in range(firsts[k], firsts[k + 1]):
                file[f"episode_{i}"] = h5py.ExternalLink(f"part-{k}.hdf5", f"/episode_{i}")


def _run_forked(work: list[Callable[[], Any]], jobs: int) -> None:
    """Run each of ``work`` in a forked process, at most ``jobs`` at a time. Every child
    ends: on success, on its error (said through a pipe as text), when this process
    stops on an error or Ctrl-C (killed here), or when it dies (``PR_SET_PDEATHSIG``).

    Raises:
        ShardReplayError: a child failed (the first one, with its error's text).
    """
    ctx = mp.get_context("fork")
    todo, running = list(enumerate(work)), dict[Any, tuple[int, Any, Any]]()
    try:
        while todo or running:
            while todo and len(running) < jobs:
                k, fn = todo.pop(0)
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_child, args=(fn, send, os.getpid()), daemon=True)
                proc.start()
                send.close()
                running[proc.sentinel] = (k, proc, recv)
            for sentinel in wait(list(running)):
                k, proc, recv = running.pop(sentinel)
                proc.join()
                if proc.exitcode != 0:
                    why = recv.recv_bytes().decode() if recv.poll() else f"exit code {proc.exitcode}"
                    raise ShardReplayError(f"the export of shard {k} failed: {why}")
    finally:
        for _k, proc, _recv in running.values():
            proc.kill()
            proc.join()


def _child(fn: Callable[[], Any], send: Any, parent: int) -> None:
    """A forked writer: dies with ``parent``; its error goes back as text."""
    # SIGKILL: a SIGTERM would only be recorded if the parent had taken it over (_signals).
    die_with_parent(parent, signal.SIGKILL)
    try:
        fn()
    except BaseException as exc:
        send.send_bytes(f"{type(exc).__name__}: {exc}".encode())
        raise SystemExit(1) from exc


def _remove_dead_leftovers(final: Path) -> None:
    """Remove the temporary directories of exports of ``final`` whose process is gone."""
    pattern = re.compile(rf"^\.{re.escape(final.name)}\.partial-(\d+)$")
    for path in final.parent.iterdir():
        match = pattern.match(path.name)
        if match is not None and not pid_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)


def prefill(buffer: ReplayBuffer | ShardedReplayBuffer, dataset_id: str) -> dict[str, int]:
    """Stream the Minari dataset ``dataset_id`` into ``buffer`` (a fresh ReplayBuffer, or
    this rank's ShardedReplayBuffer: every rank calls it, no collective; how episodes are
    dealt and prioritized: docs/offline.md, "Import and warm start"). Returns this rank's
    ``{episodes, steps}``.

    Raises:
        ConfigError: the minari extra is missing, no such dataset, or a dataset whose
            observations or actions are not Box or Discrete, or do not fit the buffer's
            ``obs``/``action`` fields.
    """
    import gymnasium as gym

    _minari()
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
    spaces = (store.observation_space, store.action_space)
    if not all(isinstance(space, (gym.spaces.Box, gym.spaces.Discrete)) for space in spaces):
        raise ConfigError(f"dataset {dataset_id!r}: prefill reads Box and Discrete spaces, not {spaces}")
    mine = _deal(_lengths(store), num_shards)
    rows = np.zeros(local.num_streams, np.int64)  # steps dealt to each row so far
    lock = buffer.write_lock if isinstance(buffer, ShardedReplayBuffer) else contextlib.nullcontext()
    pending: dict[int, list[dict[str, np.ndarray]]] = {}  # each row's episodes not yet written

    def flush(row: int) -> None:
        eps = pending.pop(row, [])
        if not eps:
            return
        step = {name: np.concatenate([ep[name] for ep in eps]) for name in eps[0]} if len(eps) > 1 else eps[0]
        prio = step.pop("priority", None)
        cap = local.stream_capacity
        with lock:
            for lo in range(0, step["reward"].shape[0], cap):  # longer than a row: the ring keeps its newest
                local.extend({name: v[None, lo:lo + cap] for name, v in step.items()}, [row],
                             None if prio is None else prio[None, lo:lo + cap])

    stored = steps = 0
    spec = local.spec
    for obs, action, reward, terminated, prio in _episodes(store, np.flatnonzero(mine == shard).tolist()):
        k = reward.shape[0] + 1
        if k < 2:
            continue
        if obs.shape[1:] != spec["obs"].shape:
            raise ConfigError(f"dataset {dataset_id!r}: observations {obs.shape[1:]}, the buffer's "
                              f"obs field {spec['obs'].shape} (an --unstack export needs a spec of "
                              "single frames)")
        step = {"obs": obs, "step_type": np.full(k, MID, np.uint8), "discount": np.ones(k, np.float32),
                "action": _padded(action, spec["action"]), "reward": _padded(reward, spec["reward"])}
        step["step_type"][0], step["step_type"][-1] = FIRST, LAST
        step["discount"][-1] = 0.0 if terminated else 1.0
        if VERSION_FIELD in spec:  # a training run's shard: not made by its actors
            step[VERSION_FIELD] = np.full(k, -1, np.int64)
        if prio is not None:
            step["priority"] = np.asarray(prio, np.float32).reshape(-1)[:k]
        row = int(np.argmin(rows))
        rows[row] += k
        if pending.get(row) and pending[row][0].keys() != step.keys():
            flush(row)  # episodes with and without priorities are written apart
        pending.setdefault(row, []).append(step)
        if sum(ep["obs"].nbytes for ep in pending[row]) >= FLUSH_BYTES:
            flush(row)
        stored += 1
        steps += k
    for row in list(pending):
        flush(row)
    return {"episodes": stored, "steps": steps}


def _lengths(store: Any) -> np.ndarray:
    """Each episode's stored steps (its transitions and one) in a Minari storage."""
    n = store.total_episodes
    if store.FORMAT != "hdf5":
        return np.asarray([int(m["total_steps"]) + 1 for m in store.get_episode_metadata(range(n))], np.int64)
    import h5py
    from h5py import h5a, h5g

    out = np.zeros((n, 1), np.int64)
    with h5py.File(Path(store.data_path) / "main_data.hdf5", "r") as file:
        for i in range(n):
            h5a.open(h5g.open(file.id, b"episode_%d" % i), b"total_steps").read(out[i].reshape(()))
    return out[:, 0] + 1


def _episodes(store: Any, ids: list[int]) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, bool, Any]]:
    """Episodes ``ids`` of a Minari storage: (observations ``[T + 1, ...]``, actions
    ``[T, ...]``, rewards ``[T]``, terminated, the ``priority`` info or None), read
    straight from the HDF5 or Arrow files Minari lays out (without its reader's cost per
    episode and dataset); JPEG-encoded images and other formats through its reader."""
    from minari.dataset.minari_storage import is_image_space

    path, spaces = Path(store.data_path), (store.observation_space, store.action_space)
    if store.FORMAT not in ("hdf5", "arrow") or (store.jpeg_encoding and any(map(is_image_space, spaces))):
        for ep in _minari().MinariDataset(store).iterate_episodes(ids):
            yield (np.asarray(ep.observations), np.asarray(ep.actions), np.asarray(ep.rewards),
                   bool(np.asarray(ep.terminations)[-1:].any()), (ep.infos or {}).get("priority"))
    elif store.FORMAT == "hdf5":
        import h5py
        from h5py import h5d, h5g, h5s

        def read(where: Any, name: bytes) -> np.ndarray:
            d = h5d.open(where, name)
            out = np.empty(d.shape, d.dtype)
            d.read(h5s.ALL, h5s.ALL, out)
            return out

        with h5py.File(path / "main_data.hdf5", "r") as file:
            for i in ids:
                g = h5g.open(file.id, b"episode_%d" % i)
                info = h5g.open(g, b"infos") if b"infos" in g else None
                yield (read(g, b"observations"), read(g, b"actions"), read(g, b"rewards"),
                       bool(read(g, b"terminations")[-1:].any()),
                       read(info, b"priority") if info is not None and b"priority" in info else None)
    else:
        import pyarrow as pa

        def flat(values: Any, space: Any = None) -> np.ndarray:  # Box rows are fixed-size lists
            rows = values.flatten() if pa.types.is_fixed_size_list(values.type) else values
            return rows.to_numpy(zero_copy_only=False).reshape(len(values), *getattr(space, "shape", ()))

        for i in ids:
            with pa.memory_map(str(path / str(i) / "part-0.arrow")) as source:
                batch = pa.ipc.open_file(source).read_all().combine_chunks().to_batches()[0]
            col = dict(zip(batch.schema.names, batch.columns, strict=True))
            prio = "infos" in col and col["infos"].type.get_field_index("priority") >= 0
            yield (flat(col["observations"], spaces[0]), flat(col["actions"], spaces[1])[:-1],
                   flat(col["rewards"])[:-1], bool(flat(col["terminations"])[-2:-1].any()),
                   flat(col["infos"].field("priority")) if prio else None)


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
