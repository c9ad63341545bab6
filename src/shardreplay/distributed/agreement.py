"""What the ranks of a :class:`ShardedReplayBuffer` agree on at construction, and the
``ConfigError`` naming the first setting they disagree on (what must agree, what may
differ, and why: docs/semantics.md, "What the ranks must agree on").
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.buffer.shard import shard_of_buffer
from shardreplay.distributed.exchange import SamplingSettings
from shardreplay.distributed.group import Collectives
from shardreplay.errors import ConfigError

SAMPLE_MODES = ("exact", "local")
_SAMPLERS = ("uniform", "prioritized")
_SPEC_OP = ("ShardedReplayBuffer(all_gather spec descriptions) (the ranks' specs differ; every rank "
            "constructs its buffer at the same point)")

# (field of SamplingSettings, what the message calls it, what the user should do), checked
# in this order after the spec; the first that differs is named.
_AGREED = (
    ("sampler", "samplers", "pass the same sampler= to every rank's ReplayBuffer"),
    ("alpha", "alphas", "pass the same alpha= to every rank's ReplayBuffer"),
    ("beta_start", "beta schedules (start)", "pass the same beta= to every rank's ReplayBuffer"),
    ("beta_end", "beta schedules (end)", "pass the same beta= to every rank's ReplayBuffer"),
    ("beta_steps", "beta schedules (steps)", "pass the same beta= to every rank's ReplayBuffer"),
    ("window", "windows", "pass the same window= to every rank's ReplayBuffer"),
    ("period", "periods", "pass the same period= to every rank's ReplayBuffer"),
    ("mode", "modes", "pass the same mode= to every rank's ShardedReplayBuffer"),
    ("prefetch", "prefetch depths", "pass the same prefetch= to every rank's ShardedReplayBuffer"),
    ("pipeline", "pipeline settings", "pass the same pipeline= to every rank's ShardedReplayBuffer"),
)


def settings_of(local: ReplayBuffer, mode: str, prefetch: int, pipeline: bool, host: int,
                region_nonce: int) -> SamplingSettings:
    """This rank's :class:`SamplingSettings` (alpha and beta are 0 for uniform shards,
    where they change nothing)."""
    prioritized: Any = shard_of_buffer(local).prioritized_settings()
    alpha, beta_start, beta_end, beta_steps = 0.0, 0.0, 0.0, 0
    if prioritized is not None:
        alpha, beta = float(prioritized[0]), prioritized[1]
        if hasattr(beta, "steps"):  # a LinearSchedule (samplers are reached only through the Shard)
            beta_start, beta_end, beta_steps = float(beta.start), float(beta.end), int(beta.steps)
        else:
            beta_start = beta_end = float(beta.value)
    spec_hex = local.spec.fingerprint
    return SamplingSettings(
        spec_fp=np.uint64(int(spec_hex, 16)).view(np.int64), spec_len=len(_spec_bytes(local)),
        sampler=_SAMPLERS.index(local.sampler_name), alpha=alpha, beta_start=beta_start,
        beta_end=beta_end, beta_steps=beta_steps, window=local.window, period=local.period,
        mode=SAMPLE_MODES.index(mode), prefetch=prefetch, pipeline=int(pipeline), host_key=host,
        nonce=region_nonce)


def check_agreed(agreed: SamplingSettings, local: ReplayBuffer, comm: Collectives) -> None:
    """Raise on every rank alike when the ranks' settings differ (a second collective
    runs only then, to name the spec field that differs).

    Raises:
        ConfigError: the ranks' specs or sampling settings differ; the message names the
            field and each rank's value.
        CollectiveTimeout: a peer did not join the spec comparison in time.
    """
    if (agreed.spec_fp != agreed.spec_fp[0]).any():
        raise ConfigError(_spec_difference(_gather_specs(local, comm, int(agreed.spec_len.max()))))
    for name, label, advice in _AGREED:
        column = np.asarray(getattr(agreed, name))
        if (column != column[0]).any():
            raise ConfigError(f"ranks constructed ShardedReplayBuffer with different {label}: "
                              f"{_per_rank(name, column)}; {advice}")


def _per_rank(name: str, column: np.ndarray) -> str:
    """Each rank's value, readable (names for the coded fields)."""
    names = {"sampler": _SAMPLERS, "mode": SAMPLE_MODES, "pipeline": ("False", "True")}.get(name)
    values = [names[int(v)] if names else v.item() for v in column]
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


def _spec_bytes(local: ReplayBuffer) -> bytes:
    return json.dumps(local.spec.to_dict(), sort_keys=True, separators=(",", ":")).encode()


def _gather_specs(local: ReplayBuffer, comm: Collectives, longest: int) -> list[dict[str, Any]]:
    """Every rank's spec description (JSON bytes padded to ``longest``; no pickling)."""
    mine = np.zeros(longest + 8, np.uint8)
    text = _spec_bytes(local)
    mine[:8] = np.frombuffer(np.int64(len(text)).tobytes(), np.uint8)
    mine[8:8 + len(text)] = np.frombuffer(text, np.uint8)
    rows = comm.all_gather(mine, _SPEC_OP)
    out = []
    for row in rows:
        n = int(row[:8].view(np.int64)[0])
        out.append(json.loads(row[8:8 + n].tobytes().decode()))
    return out


def _spec_difference(specs: list[dict[str, Any]]) -> str:
    """The first spec field whose presence or description differs between the ranks."""
    advice = "every rank must build its ReplayBuffer with the same Spec"
    for name in sorted(set().union(*specs)):
        have = [r for r, s in enumerate(specs) if name in s]
        if len(have) < len(specs):
            return (f"ranks constructed ShardedReplayBuffer with different specs: field {name!r} is "
                    f"only on ranks {have}; {advice}")
        for attr in sorted(set().union(*(s[name] for s in specs))):
            values = [s[name].get(attr) for s in specs]
            if any(v != values[0] for v in values):
                shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                return (f"ranks constructed ShardedReplayBuffer with different specs: field "
                        f"{name!r} has different {attr} ({shown}); {advice}")
    return f"ranks constructed ShardedReplayBuffer with different specs; {advice}"
