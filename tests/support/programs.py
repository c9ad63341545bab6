"""Random write programs for the core tests: hypothesis strategies and a seeded generator.

A program is a layout (streams, stream capacity, window) and a list of writes. A write
is ``add`` (one step per stream) or ``extend`` (``T`` steps per stream), for all streams
or a subset in any order, with step types drawn so that every odd case occurs: FIRST
after MID (abandoned episode), MID right after LAST, streams starting with MID,
truncations (LAST, discount 1) and terminations (LAST, discount 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from shardreplay import ReplayBuffer
from tests.support.reference import FIRST, LAST, MID, RefBuffer

# MID twice: episodes longer than one step are common, so windows complete.
STEP_TYPES = (FIRST, MID, MID, LAST)
PRIORITY_VALUES = (0.0, 0.25, 1.0, 2.0, 3.5)


@dataclass(frozen=True)
class Write:
    """One ``add`` / ``extend`` call."""

    kind: str  # "add" or "extend"
    rows: tuple[int, ...] | None  # None: all streams, in order
    types: np.ndarray  # [n, T] step types
    discounts: np.ndarray  # [n, T]
    priorities: np.ndarray | None  # [n, T] or None

    def row_list(self, num_streams: int) -> list[int]:
        """The streams written, in order."""
        return list(range(num_streams)) if self.rows is None else list(self.rows)


@dataclass(frozen=True)
class Program:
    """A buffer layout and the writes to apply."""

    num_streams: int
    capacity: int
    window: int
    writes: tuple[Write, ...]


def _discounts(types: np.ndarray, truncate: np.ndarray) -> np.ndarray:
    """0 at a terminating LAST, 1 at a truncating LAST and everywhere else."""
    return np.where((types == LAST) & ~truncate, 0.0, 1.0).astype(np.float32)


@st.composite
def writes(draw: st.DrawFn, num_streams: int, capacity: int, with_priorities: bool) -> Write:
    """One random write."""
    kind = draw(st.sampled_from(["add", "extend"]))
    rows = None if draw(st.booleans()) else tuple(
        draw(st.lists(st.integers(0, num_streams - 1), min_size=1, max_size=num_streams, unique=True)))
    n = num_streams if rows is None else len(rows)
    t_len = 1 if kind == "add" else draw(st.integers(1, capacity))
    types = np.array(draw(st.lists(st.sampled_from(STEP_TYPES), min_size=n * t_len,
                                   max_size=n * t_len)), np.int64).reshape(n, t_len)
    truncate = np.array(draw(st.lists(st.booleans(), min_size=n * t_len, max_size=n * t_len)))
    prios = None
    if with_priorities and draw(st.booleans()):
        prios = np.array(draw(st.lists(st.sampled_from(PRIORITY_VALUES), min_size=n * t_len,
                                       max_size=n * t_len)), np.float64).reshape(n, t_len)
    return Write(kind, rows, types, _discounts(types, truncate.reshape(n, t_len)), prios)


@st.composite
def programs(draw: st.DrawFn, max_writes: int = 10, with_priorities: bool = False,
             windows: tuple[int, ...] = (1, 2, 3, 4)) -> Program:
    """A random layout (1-3 streams, capacity 3-7, window in ``windows``) and writes."""
    num_streams = draw(st.integers(1, 3))
    capacity = draw(st.integers(3, 7))
    window = draw(st.sampled_from([w for w in windows if w <= capacity]))
    ops = draw(st.lists(writes(num_streams, capacity, with_priorities), min_size=1,
                        max_size=max_writes))
    return Program(num_streams, capacity, window, tuple(ops))


def random_program(rng: np.random.Generator, num_streams: int, capacity: int, window: int,
                   n_writes: int, with_priorities: bool = False) -> Program:
    """A seeded program (for tests that need the same program every run)."""
    ops = []
    for _ in range(n_writes):
        kind = "add" if rng.random() < 0.5 else "extend"
        rows = None if rng.random() < 0.4 else tuple(
            int(r) for r in rng.permutation(num_streams)[:rng.integers(1, num_streams + 1)])
        n = num_streams if rows is None else len(rows)
        t_len = 1 if kind == "add" else int(rng.integers(1, capacity + 1))
        types = rng.choice(np.array(STEP_TYPES), size=(n, t_len))
        truncate = rng.random((n, t_len)) < 0.5
        prios = None
        if with_priorities and rng.random() < 0.5:
            prios = rng.choice(np.array(PRIORITY_VALUES), size=(n, t_len))
        ops.append(Write(kind, rows, types, _discounts(types, truncate), prios))
    return Program(num_streams, capacity, window, tuple(ops))


def apply_write(buf: ReplayBuffer, ref: RefBuffer | None, op: Write) -> None:
    """Give ``op`` to the buffer (and the reference, which makes the field values)."""
    rows = op.row_list(buf.num_streams)
    if ref is None:
        n, t_len = op.types.shape
        data = {"obs": np.zeros((n, t_len, 2), np.float32), "act": np.zeros((n, t_len), np.int64)}
    else:
        data = ref.write(rows, op.types, op.discounts, op.priorities)
    step = {**data, "step_type": op.types, "discount": op.discounts}
    prios = op.priorities
    if op.kind == "add":
        step = {k: v[:, 0] for k, v in step.items()}
        prios = None if prios is None else prios[:, 0]
        buf.add(step, stream_ids=None if op.rows is None else np.array(op.rows), priorities=prios)
    else:
        buf.extend(step, stream_ids=None if op.rows is None else list(op.rows), priorities=prios)


def make_buffer(prog: Program, **kwargs) -> ReplayBuffer:
    """A buffer of the program's layout on the reference spec."""
    from tests.support.reference import SPEC

    return ReplayBuffer(SPEC, num_streams=prog.num_streams, stream_capacity=prog.capacity,
                        window=prog.window, **kwargs)


__all__ = ["FIRST", "LAST", "MID", "Program", "Write", "apply_write", "make_buffer", "programs",
           "random_program", "writes"]
