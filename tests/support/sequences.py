"""Sequence-window helpers shared by the buffer, sharded and checkpoint tests: random
timelines, a writer that names every step by ``(stream id, time)``, and the plain-Python
reference of which starts are valid (docs/semantics.md, "Sequence windows")."""

from __future__ import annotations

import numpy as np

import shardreplay as sr

FIRST, MID, LAST = 0, 1, 2
# obs = (stream id, time); h = a recurrent state derived from both (distinct per step).
SPEC = sr.Spec({"obs": sr.Field((2,), np.int64), "h": sr.Field((3,), np.float32)})
# The same with ``h`` kept once per window start (``at_starts``): samples hold it [B, 1, 3].
START_SPEC = sr.Spec({"obs": sr.Field((2,), np.int64), "h": sr.Field((3,), np.float32, at_starts=True)})


def state_of(obs: np.ndarray) -> np.ndarray:
    """The ``h`` that :func:`step` writes for steps ``obs [..., 2]`` (stream id, time)."""
    return (obs[..., :1] * 1000 + obs[..., 1:] + np.array([0.25, 0.5, 0.75])).astype(np.float32)


def timelines(rng: np.random.Generator, streams: int, steps: int, p_abandon: float = 0.05,
              end_last: bool = False) -> list[list[int]]:
    """Random step types per stream: episode ends (12 %), episodes abandoned by a FIRST
    (``p_abandon``); with ``end_last`` every stream's last step is a LAST."""
    out = []
    for _ in range(streams):
        types, prev = [], LAST
        for _t in range(steps):
            u = rng.random()
            t = FIRST if prev == LAST else (LAST if u < 0.12 else FIRST if u > 1 - p_abandon else MID)
            types.append(t)
            prev = t
        if end_last:  # no episode left open (a save would seal it, adding windows)
            types[-1] = LAST
        out.append(types)
    return out


def step(ids: np.ndarray, t: np.ndarray, types: np.ndarray, lead: tuple[int, ...]) -> dict:
    """Steps whose ``obs`` is ``(stream id, time)`` and whose state ``h`` derives from both."""
    obs = np.stack(np.broadcast_arrays(ids.reshape(-1, *([1] * (len(lead) - 1))), t), -1).reshape(*lead, 2)
    h = state_of(obs)
    return {"obs": obs, "h": h, "step_type": types.reshape(lead),
            "discount": np.where(types == LAST, 0.0, 1.0).astype(np.float32).reshape(lead)}


def write(buf: sr.ReplayBuffer, lines: list[list[int]], rng: np.random.Generator, id_base: int = 0) -> None:
    """Write the timelines in random pieces: chunks of every stream, or single steps of
    some (two calls over disjoint stream subsets). Stream ``r`` is named ``id_base + r``."""
    streams, steps = len(lines), len(lines[0])
    types = np.array(lines, np.uint8)
    t = 0
    while t < steps:
        if rng.random() < 0.5:
            n = int(rng.integers(1, min(steps - t, buf.stream_capacity) + 1))
            rows = np.arange(streams)
            buf.extend(step(id_base + rows, np.arange(t, t + n)[None], types[:, t:t + n], (streams, n)))
            t += n
        else:
            for part in np.array_split(rng.permutation(streams), 2):
                if part.size:
                    buf.add(step(id_base + part, np.full(part.shape, t), types[part, t], (part.shape[0],)),
                            stream_ids=part)
            t += 1


def reference_starts(lines: list[list[int]], cap: int, window: int, period: int, id_base: int = 0
                     ) -> dict[tuple[int, int], int]:
    """Valid starts ``(stream id, time) -> unmasked steps``, from the rules, in plain Python."""
    out = {}
    for row, types in enumerate(lines):
        n = len(types)
        episode, offset = [], []
        for t, st_t in enumerate(types):
            new = t == 0 or st_t == FIRST or types[t - 1] == LAST
            episode.append(t if new else episode[-1])
            offset.append(0 if new else offset[-1] + 1)
        for q in range(max(0, n - cap), n):
            if offset[q] % period or (window > 1 and types[q] == LAST):
                continue
            length = None
            for k in range(1, window):
                if q + k >= n or episode[q + k] != episode[q]:
                    break
                if types[q + k] == LAST:
                    length = k + 1
                    break
            else:
                length = window
            if length is not None:
                out[(id_base + row, q)] = length
    return out
