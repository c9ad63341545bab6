"""Warm the caches that every process of a run shares, once, before pytest-xdist starts
its workers: numba's kernel cache and Python's bytecode cache.

Every kernel is compiled with ``cache=True`` into ``src/shardreplay/kernels/__pycache__``
(or ``NUMBA_CACHE_DIR``), which all processes share. On a fresh checkout the cache is
empty, and each xdist worker would compile the same kernels at the same time on the same
cores; compiled once here, every worker (and every process a test starts) loads them.
Besides a small buffer of each sampler, one short ``shardreplay train`` launch runs here
(:data:`LAUNCH_ARGS`): the kernels its learners compile are those of most launches in the
suite, whose collectives must not wait on a cold compile (one failed so, its peer rank
20 s late at the first sync).

``make install`` installs without compiling bytecode (``pip --no-compile``: compiling
every file of every package took 48 CPU-seconds; the suite imports a fraction of them).
The first process to import a module writes its ``.pyc``; six workers importing torch at
once would each compile it, so one process here imports what the suite imports most.

Both run as child processes, side by side (``python -m tests.support.warm kernels|modules``),
so the controller itself stays free of torch and numba.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# What most tests or the processes they start import: torch._dynamo comes with DDP and
# every torch optimizer step.
HEAVY_MODULES = ("torch", "torch.distributed", "torch._dynamo", "numba", "scipy.stats", "gymnasium",
                 "matplotlib.figure", "psutil", "redis", "hypothesis", "safetensors.numpy", "msgpack",
                 "tensordict", "torchrl")
_WARM_TIMEOUT_S = 600.0
# A short launch of the demo's kind (DQN on CartPole, 2 learners, 1 actor). Its learners
# compile what every launch's learners run (the chunk ingest, prioritized sampling, the
# sharded exchange of keys and priorities); left cold, the first tests' launches, all
# starting at once on a loaded machine, compile them within collective timeouts of 20-60 s.
LAUNCH_ARGS = ("train", "--learners", "2", "--actors", "1", "--total-env-steps", "400",
               "--min-replay", "200", "--hidden", "32", "32", "--eval-episodes", "1",
               "--eval-interval-updates", "100000", "--no-progress", "--no-plot", "--max-minutes", "5",
               "--collective-timeout-s", "300")
_LAUNCH_TIMEOUT_S = 400.0


def cache_is_cold() -> bool:
    """No index file in the kernels' ``__pycache__`` (a fresh checkout), or a cache directory
    of numba's own (``NUMBA_CACHE_DIR``) that this cannot read cheaply: warm it."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return True
    spec = importlib.util.find_spec("shardreplay.kernels")  # the package only: no numba import
    if spec is None or spec.origin is None:
        return True
    return not any((Path(spec.origin).parent / "__pycache__").glob("*.nbi"))


def bytecode_is_cold() -> bool:
    """torch has no bytecode cache yet (installed without compiling it) and this process
    may write one (no ``PYTHONDONTWRITEBYTECODE``)."""
    if sys.dont_write_bytecode:
        return False
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    pyc = Path(spec.origin).parent / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc"
    return not pyc.exists()


def warm_caches(root: Path) -> None:
    """Warm whichever of the two caches is cold, in child processes side by side; a child
    that fails or hangs costs only speed (the tests compile what is missing), so this
    says so on stderr and returns."""
    jobs = [job for job, cold in (("kernels", cache_is_cold()), ("modules", bytecode_is_cold())) if cold]
    procs = {job: subprocess.Popen([sys.executable, "-m", "tests.support.warm", job], cwd=root,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for job in jobs}
    for job, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=_WARM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode != 0:
            sys.stderr.write(f"warming the {job} cache failed (exit {proc.returncode}); the tests "
                             f"compile as they go:\n{err[-2000:]}\n")


def import_heavy_modules() -> None:
    """Import :data:`HEAVY_MODULES`, writing their bytecode."""
    for name in HEAVY_MODULES:
        importlib.import_module(name)


def warm_kernel_cache() -> None:
    """Write, sample and update a small buffer of each sampler: the kernels of the write,
    validation, sampling and priority paths are compiled (or loaded) and cached."""
    import shardreplay as sr

    spec = sr.Spec({"obs": sr.Field((4,), np.float32)})
    types = np.array([0, 1, 1, 1, 2], np.uint8)  # FIRST, MID, MID, MID, LAST
    for sampler in ("uniform", "prioritized", "fifo"):
        buf = sr.ReplayBuffer(spec, num_streams=2, stream_capacity=64, sampler=sampler, window=2)
        for t in range(20):
            buf.add({"obs": np.zeros((2, 4), np.float32), "step_type": np.full(2, types[t % 5]),
                     "discount": np.ones(2, np.float32)})
        batch = buf.sample(8)
        if sampler == "prioritized":
            buf.update_priorities(batch.keys, np.ones(8, np.float32))


def warm_launch_kernels() -> None:
    """Run :data:`LAUNCH_ARGS` to its end. Raises ``RuntimeError`` when it fails (its
    output in the message), ``subprocess.TimeoutExpired`` past ``_LAUNCH_TIMEOUT_S``; its
    process tree is stopped either way."""
    from tests.support.train_runs import TrainRun

    with tempfile.TemporaryDirectory() as tmp, \
            TrainRun([*LAUNCH_ARGS, "--run-dir", f"{tmp}/run"], Path(tmp)) as run:
        code = run.wait(_LAUNCH_TIMEOUT_S)
        if code != 0:
            raise RuntimeError(f"the warming launch exited {code}" + run.explain())


def warm_kernels() -> None:
    """:func:`warm_kernel_cache`, then :func:`warm_launch_kernels`."""
    warm_kernel_cache()
    warm_launch_kernels()


if __name__ == "__main__":
    {"kernels": warm_kernels, "modules": import_heavy_modules}[sys.argv[1]]()
