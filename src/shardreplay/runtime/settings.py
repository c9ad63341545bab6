"""TrainSettings: every setting of a training run in six frozen groups (run, learners,
replay, actors, transport, checkpoints), each validated on construction; every setting
also has one flat name, its ``shardreplay train`` flag (``--replay-capacity`` is
``replay.capacity``). The groups, names and YAML shapes: docs/train.md, "Settings".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardreplay.errors import ConfigError, IncompleteCheckpointError
from shardreplay.runtime.envs import EnvSource, env_source
from shardreplay.runtime.run_identity import check_run_id
from shardreplay.runtime.stream_layout import StreamLayout
from shardreplay.transport.urls import file_url, parse_medium, with_policy_key

# The Q-networks, algorithms (--algo) and chunk compressions, and where learners and actors
# compute: named here, free of torch, so settings check them without importing it.
NETWORKS = ("auto", "mlp", "nature", "minatar")
ALGOS = ("dqn", "sac", "r2d2")
COMPRESSIONS = ("auto", "none", "lz4", "zstd")
DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")


def _flag(default: Any, flat: str) -> Any:
    """A field whose flat name (flag, YAML key) differs from its name in the group."""
    return field(default=default, metadata={"flat": flat})


def _validate(group: Any, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()) -> None:
    """Check (and normalise) every field's type, then the ranges; raises ConfigError
    naming the flat setting and what is allowed."""
    flat = {f.name: flat_name(f) for f in dataclasses.fields(group)}
    for f in dataclasses.fields(group):
        object.__setattr__(group, f.name, _typed(flat[f.name], f.type, getattr(group, f.name)))
    for name in positive:
        if getattr(group, name) <= 0:
            raise ConfigError(f"{flat[name]} must be > 0, got {getattr(group, name)}")
    for name in non_negative:
        if getattr(group, name) < 0:
            raise ConfigError(f"{flat[name]} must be >= 0, got {getattr(group, name)}")


def check_device_name(flat: str, value: str) -> None:
    """Raises ConfigError unless ``value`` is ``cpu``, ``cuda`` or ``cuda:N``."""
    if not DEVICE_PATTERN.fullmatch(value):
        raise ConfigError(f"{flat} must be cpu, cuda or cuda:N, got {value!r}")


def flat_name(f: dataclasses.Field) -> str:
    """The flat name (flag without ``--``, dashes as underscores) of a group's field."""
    return str(f.metadata.get("flat", f.name))


# A scalar field's type -> the values it takes (a bool is no number), the error's words, the conversion.
_SCALARS: dict[str, tuple[type, str, Callable[[Any], Any]]] = {
    "bool": (bool, "true or false", bool), "int": (numbers.Integral, "a whole number", int),
    "float": (numbers.Real, "a number", float), "str": (str, "a string", str)}


def _typed(flat: str, kind: Any, value: Any) -> Any:
    """``value`` as the field type ``kind`` names (an annotation string), or ConfigError."""
    kind = str(kind)
    if kind in _SCALARS:
        cls, words, convert = _SCALARS[kind]
        if not isinstance(value, cls) or (isinstance(value, bool) and cls is not bool):
            raise ConfigError(f"{flat} must be {words}, got {value!r}")
        return convert(value)
    if kind == "float | str":  # stop_return: a number, none or auto
        return _target(flat, value)
    # tuple[int, ...]: the hidden layer sizes
    if isinstance(value, list | tuple) and value and all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) and int(v) >= 1 for v in value):
        return tuple(int(v) for v in value)
    raise ConfigError(f"{flat} must be a list of whole numbers >= 1, got {value!r}")


def _target(flat: str, value: Any) -> float | str:
    """A stop target: a number (also given as text, as a flag is), ``none`` or ``auto``."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if isinstance(value, str):
        if value.strip().lower() in ("none", "auto"):
            return value.strip().lower()
        with contextlib.suppress(ValueError):
            number = float(value)
            if math.isfinite(number):
                return number
    raise ConfigError(f"{flat} must be a number (the target mean return), none (never stop on a return) "
                      f"or auto (the env's reward_threshold), got {value!r}")


@dataclass(frozen=True)
class RunSettings:
    """What the run does and when it stops.

    Attributes:
        env_id: gymnasium id: Discrete actions (Box for sac), vector or image observations.
        env_import: modules that register the id, comma-separated.
        env_kwargs: gymnasium.make keyword arguments, a JSON object.
        run_dir: where config, metrics, checkpoints and the plot go ('' = runs/<time>).
        total_env_steps: stop after this many environment steps (all actors).
        max_minutes: stop training after this wall time (the final checkpoint and
            evaluation come after it: about eval_episodes more episodes).
        stop_return: stop when the evaluation mean return reaches this number; none:
            never; auto: the env's gymnasium reward_threshold where it has one, else never.
        eval_episodes: episodes of the greedy policy per full evaluation.
        eval_interval_updates: learner updates between quick evaluations.
        quick_eval_episodes: episodes of a quick evaluation; one that reaches
            stop_return is followed by a full one, which decides.
        seed: base seed.
        progress: show a live progress bar (rank 0).
        plot: draw learning_curve.png at the end of the run (rank 0; about a CPU-second
            of matplotlib; metrics.csv holds the same numbers).
    """

    env_id: str = "CartPole-v1"
    env_import: str = ""
    env_kwargs: str = ""
    run_dir: str = ""
    total_env_steps: int = 200_000
    max_minutes: float = 10.0
    stop_return: float | str = "auto"
    eval_episodes: int = 20
    eval_interval_updates: int = 500
    quick_eval_episodes: int = 5
    seed: int = 0
    progress: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        _validate(self, positive=("total_env_steps", "max_minutes", "eval_episodes",
                                  "eval_interval_updates", "quick_eval_episodes"))
        env_source(self.env_id, self.env_import, self.env_kwargs)  # a bad JSON object fails here

    @property
    def source(self) -> EnvSource:
        """How actors and evaluation make the environment."""
        return env_source(self.env_id, self.env_import, self.env_kwargs)

    def stop_target(self, reward_threshold: float | None) -> tuple[float | None, str]:
        """The mean return that stops the run (None: none does) and where it came from,
        given the env's gymnasium ``reward_threshold`` (None where it has none)."""
        if isinstance(self.stop_return, float):
            return self.stop_return, "--stop-return"
        if self.stop_return == "none":
            return None, "--stop-return none"
        if reward_threshold is None:
            return None, f"{self.env_id} has no reward_threshold"
        return float(reward_threshold), f"{self.env_id}'s reward_threshold"


@dataclass(frozen=True)
class LearnerSettings:
    """The learner ranks and their Q-learning.

    Attributes:
        algo: dqn, sac (Box actions) or r2d2 (LSTM, sequences).
        count: learner ranks (shards of the replay buffer).
        batch_size: windows sampled per rank per update.
        n_step: n of the n-step return (the window is n + 1 steps).
        gamma: discount, in (0, 1].
        lr: Adam learning rate.
        target_update_interval: updates between target-network copies.
        hidden: hidden layer sizes of the MLP Q-network (r2d2: the last is the LSTM's).
        network: Q-network: auto (by observation shape), mlp, nature or minatar.
        device: where learners train: cpu, cuda or cuda:N.
        publish_interval_updates: updates between weight broadcasts to the actors.
        collective_timeout_s: how long ranks wait for each other.
        seq_len: r2d2: steps per sampled sequence.
        seq_period: r2d2: steps between sequence starts in an episode.
        burn_in: r2d2: steps unrolled from the stored state without loss.
    """

    algo: str = "dqn"
    count: int = _flag(1, "learners")
    batch_size: int = 64
    n_step: int = 3
    gamma: float = 0.99
    lr: float = 2.3e-3
    target_update_interval: int = 10
    hidden: tuple[int, ...] = (256, 256)
    network: str = "auto"
    device: str = "cpu"
    publish_interval_updates: int = 25
    collective_timeout_s: float = 300.0
    seq_len: int = 16
    seq_period: int = 8
    burn_in: int = 4

    def __post_init__(self) -> None:
        _validate(self, positive=("count", "batch_size", "n_step", "lr", "target_update_interval",
                                  "publish_interval_updates", "collective_timeout_s", "seq_len",
                                  "seq_period"), non_negative=("burn_in",))
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"gamma must lie in (0, 1], got {self.gamma}")
        if self.network not in NETWORKS:
            raise ConfigError(f"network must be one of {', '.join(NETWORKS)}, got {self.network!r}")
        check_device_name("device", self.device)
        if self.algo not in ALGOS:
            raise ConfigError(f"algo must be one of {', '.join(ALGOS)}, got {self.algo!r}")
        if self.algo in ("r2d2", "sac") and self.network not in ("auto", "mlp"):
            raise ConfigError(f"--algo {self.algo} takes flat vector observations, not the image network "
                              f"--network {self.network}: leave --network out")
        if self.algo == "r2d2":
            if self.seq_period > self.seq_len:
                raise ConfigError(f"seq_period ({self.seq_period}) must be <= seq_len ({self.seq_len}): "
                                  "sequences would leave steps of an episode out")
            if self.burn_in + self.n_step >= self.seq_len:
                raise ConfigError(f"--algo r2d2 needs burn_in + n_step < seq_len (a sequence learns from "
                                  f"its steps after the burn-in whose n-step target lies inside it), got "
                                  f"{self.burn_in} + {self.n_step} >= {self.seq_len}: raise --seq-len")


@dataclass(frozen=True)
class ReplaySettings:
    """The sharded prioritized replay buffer and how it is sampled.

    Attributes:
        capacity: steps of replay per learner rank.
        alpha: prioritization exponent (0: uniform).
        beta_start: importance-sampling exponent at the first update.
        beta_end: importance-sampling exponent after beta_updates updates.
        beta_updates: updates over which beta goes linearly from beta_start to beta_end.
        samples_per_insert: how often each inserted step is sampled on average.
        min_replay: global windows before learning starts.
        sample_mode: exact (one global distribution) or local (own shard, weighted).
        prefetch: batches per replay exchange (k: 1/k of the collectives; a batch may
            miss k - 1 updates' priorities).
        pipeline: draw the next batch on a thread while this one trains (a batch
            misses at most one update's priorities).
        prefill: replay filled first from a Minari dataset.
        offline: train on a Minari dataset alone (no actors).
    """

    capacity: int = _flag(100_000, "replay_capacity")
    alpha: float = 0.6
    beta_start: float = 0.4
    beta_end: float = 1.0
    beta_updates: int = 20_000
    samples_per_insert: float = 32.0
    min_replay: int = 1000
    sample_mode: str = "exact"
    prefetch: int = 1
    pipeline: bool = True
    prefill: str = ""
    offline: str = ""

    def __post_init__(self) -> None:
        for name in ("prefill", "offline"):
            value = getattr(self, name)
            if value and not (value.startswith("minari:") and len(value) > 7):
                raise ConfigError(f"{name} must be minari:ID (a Minari dataset id), got {value!r}")
        if self.prefill and self.offline:
            raise ConfigError("give --prefill (then actors go on) or --offline (the dataset alone), not both")
        _validate(self, positive=("capacity", "beta_updates", "samples_per_insert", "prefetch"),
                  non_negative=("alpha", "min_replay"))
        for name in ("beta_start", "beta_end"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"{name} must lie in [0, 1], got {getattr(self, name)}")
        if self.sample_mode not in ("exact", "local"):
            raise ConfigError(f"sample_mode must be 'exact' or 'local', got {self.sample_mode!r}")


@dataclass(frozen=True)
class ActorPoolSettings:
    """The actors: how many, where, and how they act and send.

    Attributes:
        count: actor processes the learners start on this machine.
        remote: actors started elsewhere (shardreplay actor, ids from actors on) that
            reach the learners through a file:// or redis:// transport.
        envs_per_actor: environments (streams) per actor.
        chunk_steps: steps per stream in an actor chunk.
        queued_chunks_per_actor: chunks that may wait in the transport per actor (a
            short queue keeps the data fresh).
        epsilon_base: Ape-X exploration: stream i of N acts with epsilon
            base^(1 + exponent i/(N-1)).
        epsilon_exponent: the exponent of the Ape-X epsilon.
        epsilon_warmup_steps: environment steps (all actors) over which epsilon falls
            from 1 to each stream's Ape-X epsilon.
        device: where actors act: cpu, cuda or cuda:N.
        max_restarts: restarts per actor after a crash.
        delivery_log_dir: each actor started here appends a JSON line per chunk its
            transport accepted to DIR/actor-<id>.jsonl ('' = none).
    """

    count: int = _flag(2, "actors")
    remote: int = _flag(0, "remote_actors")
    envs_per_actor: int = 4
    chunk_steps: int = 8
    queued_chunks_per_actor: int = 2
    epsilon_base: float = 0.4
    epsilon_exponent: float = 7.0
    epsilon_warmup_steps: int = 8000
    device: str = _flag("cpu", "actor_device")
    max_restarts: int = _flag(3, "max_actor_restarts")
    delivery_log_dir: str = ""

    def __post_init__(self) -> None:
        _validate(self, positive=("envs_per_actor", "chunk_steps", "queued_chunks_per_actor"),
                  non_negative=("count", "remote", "epsilon_warmup_steps", "max_restarts"))
        check_device_name("actor_device", self.device)


@dataclass(frozen=True)
class TransportSettings:
    """Where actors' chunks and the learners' weights travel.

    Attributes:
        url: local, file:///dir or redis://host:port/db.
        policy_url: where weights are published ('' = file://<run_dir>/policy, or the
            transport's Redis URL).
        run_id: names the run's Redis keys shardreplay:<run_id>:* ('' = random).
        compression: of chunks on file:// and redis://: auto, none, lz4, zstd.
    """

    url: str = _flag("local", "transport")
    policy_url: str = ""
    run_id: str = ""
    compression: str = "auto"

    def __post_init__(self) -> None:
        _validate(self)
        check_run_id(self.run_id)
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"compression must be one of {', '.join(COMPRESSIONS)}, "
                              f"got {self.compression!r}")
        try:
            parse_medium(self.url)
        except ConfigError:
            raise ConfigError(f"transport must be local, file:///dir or redis://host:port/db, "
                              f"got {self.url!r}") from None


@dataclass(frozen=True)
class CheckpointSettings:
    """When the replay and the learner are checkpointed (always at the end of a run;
    periodic ones are written in the background and incrementally).

    Attributes:
        interval_updates: every N updates (0: off).
        interval_minutes: every X minutes (0: off).
        keep_last: complete checkpoints kept.
        keep_rollouts: keep every stored chunk (<run_dir>/rollouts).
        keep_rollouts_max_gb: its cap in GB, oldest dropped.
    """

    interval_updates: int = _flag(0, "checkpoint_interval_updates")
    interval_minutes: float = _flag(10.0, "checkpoint_interval_minutes")
    keep_last: int = _flag(2, "keep_last")
    keep_rollouts: bool = _flag(False, "keep_rollouts")
    keep_rollouts_max_gb: float = _flag(0.0, "keep_rollouts_max_gb")

    def __post_init__(self) -> None:
        _validate(self, positive=("keep_last",),
                  non_negative=("interval_updates", "interval_minutes", "keep_rollouts_max_gb"))


# The groups of TrainSettings, in the order of ``shardreplay train --help``.
GROUPS: dict[str, type] = {"run": RunSettings, "learners": LearnerSettings, "replay": ReplaySettings,
                           "actors": ActorPoolSettings, "transport": TransportSettings,
                           "checkpoints": CheckpointSettings}
# flat name -> (group, field)
FLAT: dict[str, tuple[str, str]] = {flat_name(f): (group, f.name) for group, cls in GROUPS.items()
                                    for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class TrainSettings:
    """A distributed Ape-X DQN run: six groups of settings (see the module docstring).

    Raises:
        ConfigError: a setting out of range or of the wrong type (named by its flat
            name, which is also its flag), or settings that contradict each other.
    """

    run: RunSettings = field(default_factory=RunSettings)
    learners: LearnerSettings = field(default_factory=LearnerSettings)
    replay: ReplaySettings = field(default_factory=ReplaySettings)
    actors: ActorPoolSettings = field(default_factory=ActorPoolSettings)
    transport: TransportSettings = field(default_factory=TransportSettings)
    checkpoints: CheckpointSettings = field(default_factory=CheckpointSettings)

    def __post_init__(self) -> None:
        for name, cls in GROUPS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"TrainSettings.{name} must be a {cls.__name__}")
        if self.actors.remote and parse_medium(self.transport.url).kind == "local":
            raise ConfigError("remote_actors need a transport they can reach: "
                              "--transport file:///shared/dir or redis://host:port/db")
        if self.total_actors == 0 and not self.replay.offline:
            raise ConfigError("actors 0 and remote_actors 0: no actor would feed the learners; give "
                              "--actors N (actor processes started here) or --remote-actors N "
                              "(shardreplay actor processes started elsewhere)")
        self.streams  # noqa: B018  (raises ConfigError when a shard would get no stream)

    @property
    def window(self) -> int:
        """Steps per sampled window: ``n_step + 1`` (r2d2: ``seq_len``)."""
        return self.learners.seq_len if self.learners.algo == "r2d2" else self.learners.n_step + 1

    @property
    def period(self) -> int:
        """Steps between window starts in an episode: 1 (r2d2: ``seq_period``)."""
        return self.learners.seq_period if self.learners.algo == "r2d2" else 1

    @property
    def total_actors(self) -> int:
        """Actors of the run: started here plus remote ones."""
        return self.actors.count + self.actors.remote

    @property
    def streams(self) -> StreamLayout:
        """Which shard and row each actor stream feeds (:mod:`shardreplay.runtime.stream_layout`)."""
        return StreamLayout(self.total_actors, self.actors.envs_per_actor, self.learners.count)

    def to_dict(self) -> dict[str, Any]:
        """JSON/YAML-ready settings, grouped (``{"replay": {"capacity": ...}, ...}``)."""
        d = dataclasses.asdict(self)
        d["learners"]["hidden"] = list(self.learners.hidden)
        return d

    def to_flat(self) -> dict[str, Any]:
        """The settings by flat name (``{"replay_capacity": ..., "alpha": ...}``)."""
        return {flat: getattr(getattr(self, group), name) for flat, (group, name) in FLAT.items()}

    @classmethod
    def from_dict(cls, d: Any) -> TrainSettings:
        """Settings from a mapping (YAML, JSON) of flat names, group sections, or both.

        Raises:
            ConfigError: ``d`` is not a mapping, an unknown name, a setting given twice
                (flat and in its group), or a bad value.
        """
        return cls().updated(d)

    def updated(self, values: Any) -> TrainSettings:
        """A copy with ``values`` (flat names and/or group sections, as in
        :meth:`from_dict`) applied.

        Raises:
            ConfigError: as :meth:`from_dict`.
        """
        flat = self.to_flat()
        flat.update(_flatten(values))
        grouped: dict[str, dict[str, Any]] = {group: {} for group in GROUPS}
        for name, value in flat.items():
            group, field_name = FLAT[name]
            grouped[group][field_name] = value
        return TrainSettings(**{g: GROUPS[g](**kw) for g, kw in grouped.items()})

    def stored(self) -> dict[str, Any]:
        """What ``config.json`` holds: :meth:`to_dict`, with every path under the run
        directory written as ``{run_dir}/...`` (:func:`from_stored` resolves them), so a
        moved run directory (or one mounted elsewhere) resumes into itself."""
        d = self.to_dict()
        root = Path(self.run.run_dir).resolve()
        for flat in _PATHS:
            group, name = FLAT[flat]
            d[group][name] = _relative(d[group][name], root)
        return d

    def with_run_dir(self, run_dir: Path) -> TrainSettings:
        """A copy with ``run_dir`` set (and the default policy URL resolved)."""
        redis = parse_medium(self.transport.url).kind == "redis"
        named = self.transport.run_id
        policy = self.transport.policy_url or \
            (with_policy_key(self.transport.url, f"shardreplay:{named}:policy") if redis and named
             else self.transport.url if redis else file_url(f"{Path(run_dir).resolve()}/policy"))
        return self.updated({"run_dir": str(run_dir), "policy_url": policy})


# The settings that may name a path under the run directory (see TrainSettings.stored).
_PATHS = ("run_dir", "transport", "policy_url", "delivery_log_dir")
RUN_DIR_MARK = "{run_dir}"


def _relative(value: str, root: Path) -> str:
    """``value`` (a directory, or a ``file://`` URL) with ``root`` written as ``{run_dir}``
    when it lies under ``root``; other values as they are."""
    url = value.startswith("file:///")
    path, query = (value[len("file://"):].partition("?")[::2]) if url else (value, "")
    if not path:
        return value
    try:
        rel = Path(path).resolve().relative_to(root)
    except ValueError:
        return value
    marked = RUN_DIR_MARK if rel == Path() else f"{RUN_DIR_MARK}/{rel.as_posix()}"
    return f"file://{marked}" + (f"?{query}" if query else "") if url else marked


def from_stored(d: Mapping[str, Any], run_dir: Path) -> TrainSettings:
    """The settings a ``config.json`` holds (:meth:`TrainSettings.stored`), with the paths
    it gives relative to the run directory resolved against ``run_dir``.

    Raises:
        ConfigError: as :meth:`TrainSettings.from_dict`.
    """
    root = str(Path(run_dir).resolve())

    def resolved(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: resolved(v) for k, v in value.items()}
        if isinstance(value, str) and RUN_DIR_MARK in value:
            return value.replace(RUN_DIR_MARK, root, 1)
        return value

    return TrainSettings.from_dict(resolved(d))


def _flatten(d: Any) -> dict[str, Any]:
    """Flat names -> values from a mapping of flat names and/or group sections."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"settings must be a mapping of names to values (YAML 'name: value' lines), "
                          f"got a {type(d).__name__}")
    flat: dict[str, Any] = {}
    unknown: list[str] = []

    def put(name: str, value: Any) -> None:
        if name in flat:
            raise ConfigError(f"{name} is given twice (as {name} and in its group {FLAT[name][0]}): keep one")
        flat[name] = value

    for key, value in d.items():
        if key in GROUPS and isinstance(value, Mapping):
            names = {f.name: flat_name(f) for f in dataclasses.fields(GROUPS[key])}
            for sub, v in value.items():
                if sub in names:
                    put(names[sub], v)
                else:
                    unknown.append(f"{key}.{sub}")
        elif key in FLAT:
            put(str(key), value)
        else:
            unknown.append(str(key))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; see shardreplay train --help")
    return flat


def settings_for_resume(run_dir: Path, overrides: dict[str, Any]) -> TrainSettings:
    """The settings of ``run_dir``'s ``config.json`` (:func:`from_stored`), with ``overrides``.

    Raises:
        IncompleteCheckpointError: ``run_dir`` holds no config.
    """
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise IncompleteCheckpointError(f"{path}: missing; is {run_dir} a shardreplay run directory?")
    saved = from_stored(json.loads(path.read_text()), run_dir)
    return saved.updated({**overrides, "run_dir": str(run_dir)})
