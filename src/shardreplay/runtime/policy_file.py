"""A trained policy as one ``.safetensors`` file (no pickle): the published network's
weights and, in the metadata, what rebuilds it without the run (:func:`policy_metadata`)
and where it came from; :func:`load_policy` rebuilds it, :func:`evaluate` plays it. A
run keeps ``best/policy.safetensors`` (replaced atomically when a full evaluation beats
it); :func:`policy_of_run` takes that one, ``latest`` or a checkpoint's by id. The
learner's per-checkpoint :class:`LearnerRecord` lives here too.
"""

from __future__ import annotations

import io
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load
from torch import nn

from shardreplay import checkpoint
from shardreplay._io import atomic_write_bytes
from shardreplay.checkpoint.manifest import check_complete, read_covered
from shardreplay.errors import CheckpointFormatError, ConfigError
from shardreplay.policy.broadcast import read_metadata, serialize
from shardreplay.runtime.algos import algorithm
from shardreplay.runtime.algos.networks import choose_network
from shardreplay.runtime.envs import EnvInfo, EnvSource, describe_env, env_source, make_vector_env
from shardreplay.runtime.settings import TrainSettings, from_stored

__all__ = ["BEST", "LEARNER_STATE", "POLICY_FORMAT", "LearnerRecord", "Policy", "best_path", "best_return",
           "evaluate", "keep_if_best", "learner_records", "load_policy", "policy_metadata", "policy_of_run",
           "record_file", "save_policy"]

log = logging.getLogger("shardreplay.learner")

POLICY_FORMAT = "shardreplay-q-network/1"  # the first files held DQN's only; ``algo`` tells them apart
BEST = "best"
LEARNER_STATE = "learner_state.pt"  # the agent's state in a checkpoint (rank 0's file)


@dataclass(frozen=True)
class LearnerRecord:
    """What a learner rank saves beside its checkpoint part (the covered JSON file
    :func:`record_file`): the run's counters, best evaluation (None: none yet), wall
    time over all lives, settings, and this rank's stored chunks (``Ingestor.state_dict()``).
    """

    counters: Mapping[str, int]
    best_eval: float | None
    wall_s: float
    settings: Mapping[str, Any] | None
    ingest: Mapping[str, Any] | None

    @classmethod
    def parse(cls, value: Any, where: str) -> LearnerRecord:
        """Parse a record (or, for a checkpoint saved before these files, a part's ``extra``).

        Raises:
            CheckpointFormatError: a field is missing or malformed.
        """
        try:  # settings and ingest are checked where they are read (TrainSettings, merge_stored)
            counters, best = {str(k): int(v) for k, v in value["counters"].items()}, value.get("best_eval")
            return cls(counters, None if best is None else float(best), float(value.get("wall_s") or 0.0),
                       value.get("settings"), value.get("ingest"))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointFormatError(f"{where}: malformed learner record ({exc!r})") from exc

    def as_bytes(self) -> bytes:
        """The file's bytes (as :meth:`parse` reads them)."""
        return json.dumps(asdict(self), sort_keys=True).encode()


def record_file(shard: int, num_shards: int) -> str:
    """The name of shard ``shard``'s :class:`LearnerRecord` in a checkpoint of ``num_shards``."""
    return f"learner-{shard:05d}-of-{num_shards:05d}.json"


def learner_records(manifest: checkpoint.Manifest) -> list[LearnerRecord]:
    """Every saved part's :class:`LearnerRecord`, in shard order, verified against the
    manifest (a checkpoint saved before these files: each part's ``extra``).

    Raises:
        CheckpointError: a record is missing, damaged or malformed.
    """
    out = []
    for part in manifest.parts:
        name = record_file(part.shard, manifest.num_shards)
        if name not in part.files and part.extra:
            out.append(LearnerRecord.parse(part.extra, f"{manifest.path} (part {part.shard})"))
            continue
        try:
            value = json.loads(read_covered(manifest, name))
        except ValueError as exc:
            raise CheckpointFormatError(f"{manifest.directory / name}: not JSON ({exc})") from exc
        out.append(LearnerRecord.parse(value, str(manifest.directory / name)))
    return out


@dataclass(frozen=True)
class Policy:
    """A rebuilt network and the metadata it came with (all strings, as stored)."""

    net: nn.Module
    meta: dict[str, str]

    @property
    def source(self) -> EnvSource:
        """The environment it was trained on."""
        m = self.meta
        return env_source(m["env_id"], m.get("env_import", ""), m.get("env_kwargs", ""))

    @property
    def algo(self) -> str:
        """The ``--algo`` it was trained with (files without one: ``dqn``)."""
        return self.meta.get("algo", "dqn")

    def greedy(self) -> Callable[[torch.Tensor | np.ndarray], np.ndarray]:
        """A new function from observations ``[B, ...]`` (tensor or numpy; no gradients) to
        the evaluation's deterministic actions (R2D2's unrolls its LSTM over the calls:
        one function per evaluation)."""
        act: Callable[[torch.Tensor], np.ndarray] = algorithm(self.algo).greedy(self.net)

        def greedy(obs: torch.Tensor | np.ndarray) -> np.ndarray:
            with torch.no_grad():  # acting, not learning: also outside the caller's no_grad
                return act(torch.as_tensor(obs))

        return greedy

    def described(self) -> dict[str, Any]:
        """The metadata as JSON values: numbers and lists as such (the file keeps text)."""
        return {k: _json_value(v) for k, v in self.meta.items()}


def evaluate(policy: nn.Module | Callable[[torch.Tensor], np.ndarray], source: EnvSource | str, episodes: int,
             seed: int, device: torch.device | None = None) -> list[float]:
    """Returns of ``episodes`` episodes, run side by side (one env each), of the environment
    ``source`` makes (a bare id: as registered). ``policy``: a function from observations
    to deterministic actions (an algorithm's ``greedy``), or a Q-network (argmax), on
    ``device`` (None: the CPU)."""
    act = (lambda obs: policy(obs).argmax(dim=1).cpu().numpy()) if isinstance(policy, nn.Module) else policy
    env, obs = make_vector_env(EnvSource(source) if isinstance(source, str) else source, episodes, seed)
    returns = np.zeros(episodes)
    done = np.zeros(episodes, bool)
    try:
        while not done.all():
            with torch.no_grad():
                actions = act(torch.as_tensor(obs, device=device))
            obs, reward, terminated, truncated, _info = env.step(actions)
            returns += np.where(done, 0.0, reward)
            done |= np.asarray(terminated) | np.asarray(truncated)
    finally:
        env.close()
    return returns.tolist()


def _json_value(text: str) -> Any:
    """``text`` as the number, list or object it spells, else as it is."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, int | float | list | dict) and not isinstance(value, bool) else text


def best_path(run_dir: Path) -> Path:
    """``<run_dir>/best/policy.safetensors``."""
    return Path(run_dir) / BEST / "policy.safetensors"


def policy_metadata(settings: TrainSettings, env: EnvInfo, **origin: Any) -> dict[str, str]:
    """The metadata that rebuilds the network of a run with ``settings`` on ``env`` (plus
    ``origin``: ``updates``, ``eval_return``, ...; None values are left out).

    Raises:
        ConfigError: the settings' network cannot take ``env``'s observations.
    """
    lrn, run = settings.learners, settings.run
    meta = {"format": POLICY_FORMAT, "algo": lrn.algo, "network": choose_network(env.obs_shape, lrn.network),
            "obs_shape": json.dumps(list(env.obs_shape)), "num_actions": str(int(env.num_actions)),
            "hidden": json.dumps([int(h) for h in lrn.hidden]), "env_id": run.env_id,
            "env_import": run.env_import, "env_kwargs": run.env_kwargs}
    if env.continuous:  # the bounds size and scale SAC's policy
        meta.update(action_low=json.dumps([float(x) for x in env.action_low]),
                    action_high=json.dumps([float(x) for x in env.action_high]))
    meta.update({k: str(v) for k, v in origin.items() if v is not None})
    return meta


def _env_of(meta: Mapping[str, str]) -> EnvInfo:
    """The :class:`EnvInfo` a policy file's network was built for (shapes and bounds)."""
    obs_shape = tuple(int(x) for x in json.loads(meta["obs_shape"]))
    low, high = json.loads(meta.get("action_low", "[]")), json.loads(meta.get("action_high", "[]"))
    dtype = np.dtype(np.uint8 if len(obs_shape) == 3 else np.float32)
    return EnvInfo(obs_shape, dtype, int(meta["num_actions"]), action_shape=(len(low),) if low else (),
                   action_low=tuple(low), action_high=tuple(high))


def save_policy(path: Path, net: nn.Module, meta: Mapping[str, str]) -> None:
    """Write ``net``'s weights with ``meta`` to ``path`` as ``.safetensors``, atomically (a
    reader sees the old file or the new one, whole).

    Raises:
        OSError: the file cannot be written.
        ConfigError: ``meta`` maps a name to a non-string.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(path), serialize(None, net.state_dict(), meta))


def keep_if_best(run_dir: Path, net: nn.Module, meta: Mapping[str, str], eval_return: float,
                 best_so_far: float) -> bool:
    """Write ``net`` to :func:`best_path` (atomically) when ``eval_return`` beats
    ``best_so_far``; returns whether it did. ``meta`` gets ``eval_return``.

    Raises:
        OSError: the file cannot be written.
    """
    if not eval_return > best_so_far:  # NaN never wins
        return False
    save_policy(best_path(run_dir), net, {**meta, "eval_return": repr(float(eval_return))})
    return True


def best_return(run_dir: Path) -> float:
    """The evaluation recorded with ``best/`` (-inf: none, or unreadable), so that a
    resumed run replaces it only with a better one."""
    path = best_path(run_dir)
    try:
        with safe_open(str(path), "pt") as f:
            return float((f.metadata() or {}).get("eval_return", "-inf"))
    except (OSError, ValueError, SafetensorError) as exc:
        if path.exists():
            log.warning("%s: unreadable (%s); the next better evaluation replaces it", path, exc)
        return -math.inf


def load_policy(path: Path) -> Policy:
    """Rebuild the network saved in ``path`` (by :func:`save_policy` or ``shardreplay
    export``) and load its weights.

    Raises:
        CheckpointFormatError: not a readable safetensors file, not one of
            :data:`POLICY_FORMAT`, an unknown ``algo``, or weights that do not fit the
            described network.
        FileNotFoundError: no such file.
    """
    data = Path(path).read_bytes()
    try:
        tensors = load(data)
        meta = read_metadata(data)
    except (SafetensorError, ValueError) as exc:
        raise CheckpointFormatError(f"{path}: not a readable safetensors file ({exc}); export one with "
                                    "shardreplay export RUN --out FILE") from exc
    if meta.get("format") != POLICY_FORMAT:
        raise CheckpointFormatError(f"{path}: metadata format {meta.get('format')!r}, expected "
                                    f"{POLICY_FORMAT!r}: not a shardreplay policy file")
    try:
        algo = algorithm(meta.get("algo", "dqn"))  # files of DQN runs before --algo carry none
        net = algo.policy_network(_env_of(meta), meta["network"], tuple(json.loads(meta["hidden"])))
        net.load_state_dict(tensors)
    except (KeyError, ValueError, IndexError, RuntimeError, ConfigError) as exc:
        raise CheckpointFormatError(f"{path}: its weights do not rebuild the network it describes: {exc}") \
            from exc
    return Policy(net.eval(), meta)


def policy_of_run(run_dir: Path, which: str = "best") -> Policy:
    """The policy ``which`` of a run directory: ``best`` (the best evaluated one),
    ``latest`` (the newest complete checkpoint's online network) or a checkpoint id.

    Raises:
        ConfigError: ``which`` is none of these, or the run has no such policy (the
            message says which ones it has).
        CheckpointError: the checkpoint is damaged or incomplete.
        CheckpointFormatError: the best policy's file is damaged, or the checkpoint's
            learner state has no network of the run's ``--algo``.
    """
    run_dir = Path(run_dir)
    if which == BEST:
        path = best_path(run_dir)
        if not path.exists():
            raise ConfigError(f"{run_dir} has no best policy yet ({path}: written at the first evaluation); "
                              "use --which latest or a checkpoint id")
        return load_policy(path)
    root = run_dir / "checkpoints"
    if which == "latest":
        cid = checkpoint.latest_complete(root)
        if cid is None:
            raise ConfigError(f"{run_dir} holds no complete checkpoint under {root}")
    else:
        try:
            cid = int(which)
        except ValueError:
            raise ConfigError(f"--which {which!r}: use best, latest or a checkpoint id "
                              f"({checkpoint.list_checkpoints(root)})") from None
    return _checkpoint_policy(run_dir, checkpoint.checkpoint_dir(root, cid), cid)


def _checkpoint_policy(run_dir: Path, directory: Path, cid: int) -> Policy:
    if not directory.is_dir():
        ids = checkpoint.list_checkpoints(directory.parent)
        raise ConfigError(f"{run_dir}: no checkpoint {cid} (it has {ids or 'none'})")
    manifest = check_complete(directory)  # a damaged or incomplete one is refused, saying why
    raw = read_covered(manifest, LEARNER_STATE)  # verified against the manifest
    state = torch.load(io.BytesIO(raw), weights_only=True)
    record = learner_records(manifest)[0]
    settings = TrainSettings.from_dict(dict(record.settings)) if record.settings is not None else \
        from_stored(json.loads((run_dir / "config.json").read_text()), run_dir)
    algo = algorithm(settings.learners.algo)
    weights = state["agent"].get(algo.policy_key)
    if weights is None:
        raise CheckpointFormatError(f"{directory}: its learner state has no {algo.policy_key!r} (the "
                                    f"published network of --algo {algo.name}, as its settings say)")
    env = describe_env(settings.run.source, algo.actions)  # the shapes the network was built for
    best = record.best_eval
    meta = policy_metadata(settings, env, updates=record.counters.get("updates"),
                           env_steps=record.counters.get("env_steps"), source=f"checkpoint {cid}",
                           best_eval_so_far=best if best is None or math.isfinite(best) else None)
    net = algo.policy_network(env, settings.learners.network, settings.learners.hidden)
    net.load_state_dict(weights)
    return Policy(net.eval(), meta)
