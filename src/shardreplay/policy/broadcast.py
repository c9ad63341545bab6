"""Policy broadcast: the learner publishes ``(version, weights)``, actors poll for new ones.

One interface, chosen by URL with :func:`~shardreplay.policy.open_publisher` /
:func:`~shardreplay.policy.open_subscriber`: ``file:///dir`` (:mod:`.file_backend`) or
``redis://host:port/db`` (:mod:`.redis_backend`). Weights travel as safetensors (never
pickle) with the version in their metadata::

    publisher = open_publisher("file:///run/policy")
    publisher.publish(7, model.state_dict())

    subscriber = open_subscriber("file:///run/policy", check_interval_s=1.0)
    update = subscriber.poll()          # cheap: None unless a newer version is there
    if update is not None:
        model.load_state_dict(update.weights)

``as_numpy=True`` gives numpy arrays (torch is then never imported). A damaged copy is
logged, counted in ``stats`` and skipped. Versions (:func:`pack_version`) and the run a
policy names (:data:`RUN_KEY`): docs/semantics.md, "Runs, learner lives and policy versions"."""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardreplay.errors import ConfigError, TransportTimeout

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "FINISHED",
    "PolicyPublisher",
    "PolicySubscriber",
    "PolicyUpdate",
    "RunInfo",
    "SubscriberStats",
    "describe_version",
    "pack_version",
    "split_version",
    "wait_for_policy",
]

logger = logging.getLogger("shardreplay.policy")
VERSION_KEY = "shardreplay.policy_version"
# The JSON run description a training run publishes with its weights (:class:`RunInfo`).
RUN_KEY = "shardreplay.run"
# A tensor of this name in a published policy says: training is over, actors may exit.
FINISHED = "shardreplay.finished"
# A version's learner life sits above this many bits of update count.
LIFE_SHIFT = 32


def pack_version(life: int, updates: int) -> int:
    """The policy version of ``updates`` in learner life ``life`` (0 for a new run, +1 at
    every resume): ordered by life first, so versions stay comparable across resumes.

    Raises:
        ConfigError: a negative part, or ``updates`` beyond 2**32 - 1.
    """
    if life < 0 or not 0 <= updates < (1 << LIFE_SHIFT):
        raise ConfigError(f"need life >= 0 and 0 <= updates < 2**{LIFE_SHIFT}, got {life}, {updates}")
    return (life << LIFE_SHIFT) | updates


def split_version(version: int) -> tuple[int, int]:
    """``(life, updates)`` of a packed version (a plain small version is life 0)."""
    return version >> LIFE_SHIFT, version & ((1 << LIFE_SHIFT) - 1)


def describe_version(version: int) -> str:
    """``"875 (life 1)"``: a version as a person reads it."""
    life, updates = split_version(version)
    return f"{updates} (life {life})"


def run_id_of(meta: Mapping[str, str]) -> str:
    """The run id in a policy's metadata ('' when it names no run: an older publisher)."""
    try:
        info = json.loads(meta.get(RUN_KEY) or "{}")
    except ValueError:
        return ""
    return str(info.get("run_id", "")) if isinstance(info, dict) else ""


@dataclass(frozen=True)
class RunInfo:
    """What a training run publishes with its policy (:data:`RUN_KEY`): the run id (it
    names its channels), the publishing learner life, the run's environment steps then,
    its base seed, the learners' transport URL and the settings actors must share with
    the learners (``shardreplay.runtime.actor.settings.AGREED``)."""

    run_id: str
    life: int
    env_steps: int
    seed: int | None
    transport: str
    settings: dict[str, Any]

    def to_meta(self) -> dict[str, str]:
        """Policy metadata carrying it."""
        return {RUN_KEY: json.dumps(dataclasses.asdict(self), sort_keys=True)}

    @classmethod
    def of(cls, update: Any) -> RunInfo | None:
        """The run description of a policy update; None when it has none (or a bad one)."""
        raw = getattr(update, "meta", {}).get(RUN_KEY)
        if not raw:
            return None
        try:
            d = json.loads(raw)
            return cls(str(d["run_id"]), int(d["life"]), int(d["env_steps"]),
                       None if d.get("seed") is None else int(d["seed"]), str(d.get("transport", "")),
                       dict(d.get("settings", {})))
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("policy: its run description is malformed (%s); ignoring it", exc)
            return None


@dataclass(frozen=True)
class PolicyUpdate:
    """A newly loaded policy.

    Attributes:
        version: its version.
        weights: name -> CPU tensor, ready for ``load_state_dict`` (numpy arrays from a
            subscriber opened with ``as_numpy=True``).
        meta: the publisher's string metadata (:data:`RUN_KEY` describes the run).
    """

    version: int
    weights: dict[str, torch.Tensor] | dict[str, np.ndarray]
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        """The run that published it ('' when unnamed)."""
        return run_id_of(self.meta)


@dataclass
class SubscriberStats:
    """What a subscriber did: version checks, weight loads, rejected copies by reason."""

    checks: int = 0
    loads: int = 0
    rejected: dict[str, int] = field(default_factory=dict)

    def reject(self, reason: str, detail: str) -> None:
        """Count and log one rejected copy of the weights."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        logger.warning("policy: rejected weights (%s): %s", reason, detail)


def serialize(version: int | None, weights: Mapping[str, Any], meta: Mapping[str, str] | None = None
              ) -> bytes:
    """Weights as safetensors bytes with ``version`` (None: none, as in a policy file) and
    ``meta`` in the metadata.

    Raises:
        ConfigError: a value is neither a torch tensor nor a numpy array, or ``meta``
            holds a non-string or the version key.
    """
    import numpy as np
    import torch
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    for name, value in weights.items():
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(np.ascontiguousarray(value))
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"weight {name!r} is a {type(value).__name__}, not a tensor or array")
        # a private contiguous CPU copy: tied weights must not share storage in safetensors
        tensors[name] = value.detach().to("cpu", copy=True).contiguous()
    extra = dict(meta or {})
    if VERSION_KEY in extra or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise ConfigError(f"policy metadata must map strings to strings without {VERSION_KEY!r}")
    return save(tensors, metadata=extra if version is None else {**extra, VERSION_KEY: str(version)})


def read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes without loading tensors.

    Raises:
        ValueError: the header is malformed.
    """
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack_from("<Q", data)
    if n > min(len(data) - 8, 100 << 20):
        raise ValueError(f"safetensors header of {n} bytes is impossible here")
    header = json.loads(bytes(data[8:8 + n]))
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise ValueError("safetensors header is not a map")
    return meta


def deserialize(data: bytes, expect_crc: int | None, stats: SubscriberStats,
                origin: str, as_numpy: bool = False) -> PolicyUpdate | None:
    """Checked weights from safetensors bytes; None (logged, counted) when damaged.
    ``as_numpy``: numpy arrays instead of torch tensors (torch is then not imported)."""
    if as_numpy:
        from safetensors.numpy import load
    else:
        from safetensors.torch import load  # type: ignore[assignment]

    if expect_crc is not None and zlib.crc32(data) != expect_crc:
        stats.reject("checksum", f"{origin}: weights do not match their checksum")
        return None
    try:
        meta = read_metadata(data)
        version = int(meta[VERSION_KEY])
        weights = load(data)
    except Exception as exc:  # safetensors, json and int() raise unrelated types on garbage
        stats.reject("format", f"{origin}: {exc}")
        return None
    stats.loads += 1
    return PolicyUpdate(version, weights, {str(k): str(v) for k, v in meta.items() if k != VERSION_KEY})


class PolicyPublisher:
    """The learner's end: versions that must increase, weights serialized once, then
    written by the medium's ``_write``."""

    _last: int | None = None

    def publish(self, version: int, weights: Mapping[str, Any], *,
                meta: Mapping[str, str] | None = None) -> None:
        """Make ``weights`` (name -> torch tensor or numpy array) the current policy,
        atomically, with string metadata ``meta`` (:data:`RUN_KEY`: the run).

        Raises:
            ConfigError: the version is not an integer above every one published before, or a
                value is not a tensor.
            TransportError / TransportTimeout: the medium failed.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ConfigError(f"a policy version must be an integer >= 0, got {version!r}")
        if self._last is not None and version <= self._last:
            raise ConfigError(f"policy version {version} does not increase (last published: {self._last})")
        self._write(version, serialize(version, weights, meta), run_id_of(meta or {}))
        self._last = version

    def _write(self, version: int, data: bytes, run: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release resources."""


class PolicySubscriber:
    """An actor's end: ``version`` and ``run_id`` of the policy held, ``stats``, the check
    interval, and taking checked weights (a copy that fails is not read again until the
    next publish).

    Raises:
        ConfigError: a negative interval.
    """

    def __init__(self, check_interval_s: float, as_numpy: bool) -> None:
        if check_interval_s < 0:
            raise ConfigError(f"check_interval_s must be >= 0, got {check_interval_s}")
        self.check_interval_s = check_interval_s
        self.as_numpy = as_numpy
        self.version: int | None = None
        self.run_id: str | None = None
        self.stats = SubscriberStats()
        self._next_check = 0.0
        self._bad: object = None  # the marker of the copy rejected last

    def poll(self) -> PolicyUpdate | None:
        """The newest policy if its version is above ``version`` or it belongs to another
        run than ``run_id``, else None (cheap)."""
        raise NotImplementedError

    def pause(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s``, waking early when the medium hints at news."""
        raise NotImplementedError

    def close(self) -> None:
        """Release resources."""

    def _is_news(self, version: int, run_id: str) -> bool:
        """Whether to take ``(version, run_id)``: the first policy, a newer version, or
        another run's."""
        return self.version is None or version > self.version or run_id != self.run_id

    def _due(self, hinted: bool = False) -> bool:
        """Whether to check now (``check_interval_s`` passed, or a hint came); counted."""
        now = time.monotonic()
        if not hinted and now < self._next_check:
            return False
        self._next_check = now + self.check_interval_s
        self.stats.checks += 1
        return True

    def _take(self, data: bytes, crc: int, version: int, run: str, origin: str, marker: object
              ) -> PolicyUpdate | None:
        """The update in ``data`` when it is whole and of ``version`` (then the current
        one, of run ``run``); else None, and ``marker`` is remembered as rejected."""
        update = deserialize(data, crc, self.stats, origin, self.as_numpy)
        if update is None or update.version != version:
            self._bad = marker
            if update is not None:
                self.stats.reject("version", f"{origin}: listed as {version}, weights say {update.version}")
            return None
        self.version, self.run_id = version, run
        return update


def wait_for_policy(subscriber: PolicySubscriber, timeout_s: float) -> PolicyUpdate:
    """Block until ``subscriber`` loads a policy newer than its current one.

    Raises:
        TransportTimeout: none arrived within ``timeout_s`` (has the learner published?).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        update = subscriber.poll()
        if update is not None:
            return update
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportTimeout(f"no policy newer than version {subscriber.version} within "
                                   f"{timeout_s} s: has the learner published one?")
        subscriber.pause(min(left, 0.05))

