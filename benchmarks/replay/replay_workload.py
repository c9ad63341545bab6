"""The replay benchmark's workload: sizes, data, step types, timing and memory probes.

The numbers are those of the peer benchmarks (TorchRL, cpprb, Reverb) measured for this
project, so that the figures of every library come from the same workload:

* capacity 1,000,000 transitions; a transition is ``obs`` float32[64], ``action`` int64,
  ``reward`` float32, ``done`` bool and, for the peers, ``next_obs`` float32[64] stored as
  its own field. shardreplay stores each step once and samples windows of 2 steps.
* 65,536 random transitions are made once (seeded) and converted to each library's native
  input format before anything is timed; the timed loops cycle through them.
* inserts in batches of 32 (32 environments stepping) until ``n_insert`` transitions;
* batches of 256 are sampled from the full buffer; prioritized replay uses alpha 0.6 and
  beta 0.4, new items get the running maximum priority, and a learner step is one sample of
  256 plus one priority update of exactly those 256 items.

Only numpy and the standard library are imported here, so a peer's child process loads
nothing but its own library.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

CAPACITY = 1_000_000
OBS_DIM = 64
ADD_BATCH = 32
SAMPLE_BATCH = 256
UPDATE_BATCH = 256
ALPHA = 0.6
BETA = 0.4
POOL = 65_536
INSERT_CHUNK_CALLS = 1_000
NUM_ACTIONS = 18
DONE_PROBABILITY = 0.01
PRIORITY_SETS = 64

# The clock of the timed loops: wall time (as the peer benchmarks), or the CPU time of the
# calling thread, which leaves out the time other processes hold the core on a shared
# machine (and the CPU time of helper threads, such as torch's intra-op pool).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}
_clock = time.perf_counter


def set_clock(name: str) -> None:
    """Time the loops with ``"wall"`` (default) or ``"cpu"`` (this thread's CPU time)."""
    global _clock
    _clock = CLOCKS[name]


# dm_env step types, as shardreplay.StepType (kept as numbers so peers need not import it).
FIRST, MID, LAST = 0, 1, 2


def make_pool(seed: int, n: int = POOL) -> dict[str, np.ndarray]:
    """The random transitions every library inserts (the timed loops cycle through them).

    Args:
        seed: seed of the generator.
        n: number of transitions.

    Returns:
        ``obs``, ``action``, ``reward``, ``done`` and ``next_obs`` arrays with ``n`` rows.
    """
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.standard_normal((n, OBS_DIM), dtype=np.float32),
        "action": rng.integers(0, NUM_ACTIONS, size=n, dtype=np.int64),
        "reward": rng.standard_normal(n, dtype=np.float32),
        "done": rng.random(n) < DONE_PROBABILITY,
        "next_obs": rng.standard_normal((n, OBS_DIM), dtype=np.float32),
    }


def split_batches(pool: dict[str, np.ndarray], batch: int = ADD_BATCH) -> list[dict[str, np.ndarray]]:
    """The pool cut into consecutive batches of ``batch`` rows (views, no copies)."""
    n = len(pool["reward"]) // batch
    return [{k: v[i * batch : (i + 1) * batch] for k, v in pool.items()} for i in range(n)]


def step_types(done: np.ndarray, *, first_call: bool) -> np.ndarray:
    """Step types of the ``[calls, streams]`` steps whose ``done`` flags are given.

    Call ``i`` holds one step of each stream; a stream's previous step is the one of call
    ``i - 1``, and the steps are inserted cyclically, so call 0 follows the last call.
    A step is FIRST at the start of its stream (``first_call``: call 0 is the very first
    step of every stream) and right after a LAST; otherwise LAST where ``done``, else MID.
    An episode's FIRST step cannot end it (dm_env: a reset is not a transition), so a
    ``done`` there is ignored.

    Args:
        done: bool ``[calls, streams]``.
        first_call: treat call 0 as each stream's first step instead of following the last
            call.

    Returns:
        uint8 ``[calls, streams]``.
    """
    calls, streams = done.shape
    types = np.empty((calls, streams), dtype=np.uint8)
    prev = np.ones(streams, dtype=bool) if first_call else None
    if prev is None:
        # The step before call 0 is the last call of the previous cycle. Its type does not
        # depend on how the cycle began: the start state is forgotten at a stream's first
        # step that is not done, so one settling pass gives every later cycle's start.
        prev = step_types(done, first_call=True)[-1] == LAST
    for i in range(calls):
        types[i] = np.where(prev, FIRST, np.where(done[i], LAST, MID))
        prev = types[i] == LAST
    return types


def random_priorities(seed: int = 1, count: int = PRIORITY_SETS) -> list[np.ndarray]:
    """Stand-ins for |TD error|: ``count`` float32 arrays of 256 values in [0.001, 2)."""
    rng = np.random.default_rng(seed)
    return [rng.uniform(1e-3, 2.0, size=UPDATE_BATCH).astype(np.float32) for _ in range(count)]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def rss_mib() -> float:
    """The process's resident set size now (VmRSS), MiB."""
    return round(_status_kib("VmRSS") / 1024.0, 1)


def peak_rss_mib() -> float:
    """The process's peak resident set size so far (VmHWM), MiB."""
    return round(_status_kib("VmHWM") / 1024.0, 1)


def time_inserts(add: Callable[[int], Any], calls: int) -> dict[str, Any]:
    """Call ``add(i)`` for ``i < calls``; rate over the whole run and median over chunks.

    Returns:
        ``insert_transitions``, ``insert_seconds``, ``insert_tps`` (transitions / total
        time), ``insert_tps_median_chunk`` and ``insert_tps_best_chunk`` (median and
        maximum over chunks of 1,000 calls).
    """
    chunk_rates: list[float] = []
    start = chunk_start = _clock()
    for i in range(calls):
        add(i)
        if (i + 1) % INSERT_CHUNK_CALLS == 0:
            now = _clock()
            chunk_rates.append(INSERT_CHUNK_CALLS * ADD_BATCH / (now - chunk_start))
            chunk_start = now
    total = _clock() - start
    return {
        "insert_transitions": calls * ADD_BATCH,
        "insert_seconds": round(total, 3),
        "insert_tps": round(calls * ADD_BATCH / total, 1),
        "insert_tps_median_chunk": round(statistics.median(chunk_rates), 1) if chunk_rates else None,
        "insert_tps_best_chunk": round(max(chunk_rates), 1) if chunk_rates else None,
    }


def time_calls(
    fn: Callable[[int], Any], *, calls: int, blocks: int, warmup: int
) -> tuple[float, float, float]:
    """Median, min and max calls/s over ``blocks`` blocks of ``calls`` calls, after warm-up.

    ``fn`` gets a running call number, which the callers use to cycle their inputs.
    """
    for i in range(warmup):
        fn(i)
    rates = []
    k = warmup
    for _ in range(blocks):
        start = _clock()
        for _ in range(calls):
            fn(k)
            k += 1
        rates.append(calls / (_clock() - start))
    return statistics.median(rates), min(rates), max(rates)


def put_rate(
    out: dict[str, Any], name: str, rate: tuple[float, float, float], per_call: int = 0, items: str = ""
) -> None:
    """Store a rate as ``name`` and ``name_range`` (and ``items`` = rate * ``per_call``)."""
    median, low, high = rate
    out[name] = round(median, 1)
    out[name + "_range"] = [round(low, 1), round(high, 1)]
    if per_call:
        out[items] = round(median * per_call, 1)
