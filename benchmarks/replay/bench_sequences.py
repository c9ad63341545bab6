"""Sequence sampling benchmark: 64 sequences of 80 steps at 1M and 10M stored steps,
shardreplay against TorchRL's ``SliceSampler`` / ``PrioritizedSliceSampler``.

What is stored (the same steps in both): ``--streams`` streams of episodes of
``--episode-len`` steps, each step ``obs`` float32[4] and ``reward`` float32 (small
fields, so 10M steps fit in memory twice). TorchRL holds them in a ``LazyTensorStorage``
with the episode id (``traj_key="episode"``) its samplers need; shardreplay in a
``ReplayBuffer(window=80)``.

What is timed: one ``sample`` of 64 sequences of 80 steps (5,120 steps with their
fields):

* ``uniform``: shardreplay ``sample(64)`` with ``period=1`` (every step may start a
  sequence, as TorchRL's ``SliceSampler``) against ``SliceSampler(slice_len=80,
  traj_key="episode")`` (default, and ``cache_values=True``, which caches the
  trajectory boundaries: valid only while the storage does not change);
* ``r2d2``: shardreplay with ``period=40`` (R2D2's overlap of 40), uniform and
  prioritized (alpha 0.9, a sum tree over the sequence starts);
* ``prioritized``: shardreplay ``period=1`` prioritized (alpha 0.9) against
  ``PrioritizedSliceSampler(alpha=0.9, beta=0.6, slice_len=80, traj_key="episode")``
  (default, and ``cache_values=True``: ``prioritized_cached``). It needs TorchRL's C++
  extension (its sum trees): the wheel's, or one rebuilt for the installed torch by
  ``build_torchrl_ext.sh PYTHON DIR --keep`` and loaded with ``--torchrl-ext FILE``;
  skipped with a note when none loads.

The machine is shared and loaded, so the libraries are timed alternately in one process
(block of one, block of the other, ``--reps`` times) and the JSON line reports each
median and the ratios ``torchrl seconds / shardreplay seconds`` (> 1: shardreplay is
faster). Memory: VmRSS growth while each library's storage was filled (MiB).

Usage::

    python benchmarks/replay/bench_sequences.py               # 1M and 10M steps (needs ~6 GiB)
    python benchmarks/replay/bench_sequences.py --quick       # 100k steps, a few calls
    python benchmarks/replay/bench_sequences.py --torchrl-ext DIR/torchrl/_torchrl.<suffix>.so
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common

import shardreplay as sr

BATCH, SEQ, R2D2_PERIOD = 64, 80, 40


def rss_mib() -> float:
    """This process's resident memory now (VmRSS), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def episode_data(steps: int, streams: int, episode_len: int, chunk: int, seed: int):
    """Chunks ``[streams, chunk]`` of step types, obs and rewards, ``steps`` in all."""
    rng = np.random.default_rng(seed)
    obs = rng.normal(size=(streams, chunk, 4)).astype(np.float32)
    reward = rng.normal(size=(streams, chunk)).astype(np.float32)
    per_stream = steps // streams
    for t0 in range(0, per_stream, chunk):
        n = min(chunk, per_stream - t0)
        t = np.arange(t0, t0 + n) % episode_len
        types = np.where(t == 0, 0, np.where(t == episode_len - 1, 2, 1)).astype(np.uint8)
        yield t0, np.broadcast_to(types, (streams, n)), obs[:, :n], reward[:, :n]


def build_ours(steps: int, streams: int, episode_len: int, period: int, sampler: str,
               seed: int) -> tuple[sr.ReplayBuffer, float]:
    """A shardreplay buffer holding ``steps`` steps; returns it and the MiB it took."""
    before = rss_mib()
    spec = sr.Spec({"obs": sr.Field((4,), np.float32), "reward": sr.Field((), np.float32)})
    buf = sr.ReplayBuffer(spec, num_streams=streams, stream_capacity=steps // streams, window=SEQ,
                          period=period, sampler=sampler, alpha=0.9, beta=0.6, seed=seed)
    for _t0, types, obs, reward in episode_data(steps, streams, episode_len, 1000, seed):
        buf.extend({"obs": obs, "reward": reward, "step_type": types})
    return buf, rss_mib() - before


def build_torchrl(steps: int, streams: int, episode_len: int, prioritized: bool, cache: bool,
                  seed: int) -> tuple[Any, float]:
    """A TorchRL ReplayBuffer of the same steps (stream after stream, an episode id per
    step) with a (prioritized) slice sampler; returns it and the MiB it took."""
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.data.replay_buffers.samplers import PrioritizedSliceSampler, SliceSampler

    before = rss_mib()
    if prioritized:
        sampler = PrioritizedSliceSampler(max_capacity=steps, alpha=0.9, beta=0.6, slice_len=SEQ,
                                          traj_key="episode", cache_values=cache)
    else:
        sampler = SliceSampler(slice_len=SEQ, traj_key="episode", cache_values=cache)
    rb = ReplayBuffer(storage=LazyTensorStorage(steps), sampler=sampler, batch_size=BATCH * SEQ)
    per_stream = steps // streams
    for t0, types, obs, reward in episode_data(steps, streams, episode_len, 1000, seed):
        n = types.shape[1]
        # Episode ids unique over streams: stream s, episode k -> s * per_stream + k.
        ep = (np.arange(streams)[:, None] * per_stream + (t0 + np.arange(n))[None] // episode_len)
        for s in range(streams):  # stream after stream would interleave chunks; ids keep them apart
            rb.extend(TensorDict({"obs": torch.from_numpy(obs[s]), "reward": torch.from_numpy(reward[s]),
                                  "episode": torch.from_numpy(ep[s])}, batch_size=[n]))
    return rb, rss_mib() - before


def alternate(ours, theirs, reps: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each, timed block after block in turn, and the ratio."""
    ours(), theirs()  # warm-up (compiles, caches)
    mine, peer = [], []
    for _ in range(reps):
        for fn, out in ((ours, mine), (theirs, peer)):
            t = time.perf_counter()
            for _c in range(calls):
                fn()
            out.append((time.perf_counter() - t) / calls)
    a, b = common.median(mine), common.median(peer)
    return {"shardreplay_ms": round(a * 1e3, 3), "torchrl_ms": round(b * 1e3, 3),
            "torchrl_over_shardreplay": round(b / a, 2)}


def time_only(fn, reps: int, calls: int) -> float:
    """Median milliseconds per call of ``fn``."""
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _c in range(calls):
            fn()
        out.append((time.perf_counter() - t) / calls)
    return round(common.median(out) * 1e3, 3)


def load_torchrl_ext(path: Path) -> None:
    """Load a rebuilt ``torchrl._torchrl`` (``build_torchrl_ext.sh ... --keep``) from ``path``
    in place of the wheel's, before anything imports torchrl: its samplers then find it in
    ``sys.modules`` (the installed package is not touched)."""
    import importlib.util

    import torch  # noqa: F401  (the extension links against libtorch)

    spec = importlib.util.spec_from_file_location("torchrl._torchrl", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--torchrl-ext {path}: not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["torchrl._torchrl"] = module


def has_torchrl_ext() -> bool:
    """Whether TorchRL's C++ extension (its sum trees) loads."""
    try:
        import torchrl._torchrl  # noqa: F401
    except Exception:
        return False
    return True


def unprioritized(steps: int, args: Any) -> dict[str, Any]:
    """The uniform cases (against ``SliceSampler``) and the R2D2 starts (shardreplay only)."""
    out: dict[str, Any] = {}
    reps, calls = args.reps, args.calls
    ours, rss = build_ours(steps, args.streams, args.episode_len, 1, "uniform", 0)
    out["rss_mib_shardreplay"] = round(rss, 1)
    if not args.with_torchrl:
        out["uniform"] = {"shardreplay_ms": time_only(partial(ours.sample, BATCH), reps, calls)}
    for cache in (False, True) if args.with_torchrl else ():
        theirs, rss = build_torchrl(steps, args.streams, args.episode_len, False, cache, 0)
        out[f"rss_mib_torchrl{'_cached' if cache else ''}"] = round(rss, 1)
        out[f"uniform{'_cached' if cache else ''}"] = alternate(partial(ours.sample, BATCH), theirs.sample,
                                                                  reps, calls)
        del theirs
    del ours
    for sampler in ("uniform", "prioritized"):
        ours, rss = build_ours(steps, args.streams, args.episode_len, R2D2_PERIOD, sampler, 0)
        out[f"r2d2_{sampler}_ms"] = time_only(partial(ours.sample, BATCH), reps, calls)
        out[f"rss_mib_shardreplay_r2d2_{sampler}"] = round(rss, 1)
        del ours
    return out


def one_size(steps: int, args: Any) -> dict[str, Any]:
    """Every case at ``steps`` stored steps (``--prioritized-only``: the prioritized ones)."""
    out: dict[str, Any] = {}
    if not args.prioritized_only:
        out.update(unprioritized(steps, args))
    if not args.with_torchrl:
        return out
    reps, calls = args.reps, args.calls
    if not has_torchrl_ext():
        out["prioritized"] = "skipped: torchrl._torchrl does not load (replay/build_torchrl_ext.sh)"
        return out
    ours, rss = build_ours(steps, args.streams, args.episode_len, 1, "prioritized", 0)
    out["rss_mib_shardreplay_prioritized"] = round(rss, 1)
    for cache in (False, True):
        name = f"prioritized{'_cached' if cache else ''}"
        began = time.perf_counter()
        theirs, rss = build_torchrl(steps, args.streams, args.episode_len, True, cache, 0)
        out[f"fill_s_torchrl_{name}"] = round(time.perf_counter() - began, 1)
        out[f"rss_mib_torchrl_{name}"] = round(rss, 1)
        out[name] = alternate(partial(ours.sample, BATCH), theirs.sample, reps, calls)
        del theirs
    return out


def main() -> None:
    """Run the sizes and print the JSON line."""
    p = common.parser(__doc__, quick="100k steps, few calls (a smoke run)", reps=5)
    p.add_argument("--sizes", default="1000000,10000000", help="stored steps, comma separated")
    p.add_argument("--streams", type=int, default=100, help="streams (rows) the steps are spread over")
    p.add_argument("--episode-len", type=int, default=500, help="steps per episode")
    p.add_argument("--calls", type=int, default=20, help="sample calls per timed block")
    p.add_argument("--torchrl-ext", type=Path,
                   help="a rebuilt torchrl._torchrl to load (build_torchrl_ext.sh ... --keep)")
    p.add_argument("--prioritized-only", action="store_true",
                   help="only the prioritized cases (shardreplay against PrioritizedSliceSampler)")
    args = p.parse_args()
    if args.torchrl_ext is not None:
        load_torchrl_ext(args.torchrl_ext)
    sizes = [100_000] if args.quick else [int(s) for s in args.sizes.split(",")]
    if args.quick:
        args.reps, args.calls = 2, 3
    import torch

    torch.set_num_threads(1)  # one core each: the comparison is per core, on a shared machine
    try:
        import torchrl
        version = torchrl.__version__
    except ImportError:
        version = None
    args.with_torchrl = version is not None
    line: dict[str, Any] = {"bench": "sequences", "batch": BATCH, "seq_len": SEQ, "r2d2_period": R2D2_PERIOD,
                            "torchrl": version, "loadavg_start": common.loadavg()}
    for steps in sizes:
        line[f"steps_{steps}"] = one_size(steps, args)
    line.update(loadavg_end=common.loadavg(), cpus=common.cpus(), python=common.python(),
                commit=common.commit(), when=common.now())
    common.emit_line(line, args.out)


if __name__ == "__main__":
    main()
