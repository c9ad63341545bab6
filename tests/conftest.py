"""Shared fixtures: a real redis-server on a free loopback port, stopped after the test.
Tests on real torch.distributed groups also count as slow (see the hook below)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardreplay.runtime.forkserver import collector_paused
from tests.support.cpu_time import LOG_ENV
from tests.support.redis import RedisServer, start_redis
from tests.support.warm import warm_caches

# One torch (OpenMP) thread in every process of the run: the xdist workers, and the ranks,
# learners and actors they start (children inherit the environment), share 2 cores, and a
# second thread per process only adds spinning and switching (the learners and actors of
# ``shardreplay train`` take one thread themselves, but only after importing torch).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    """``SHARDREPLAY_CPU_LOG=path``: log CPU-seconds per test (:mod:`tests.support.cpu_time`)."""
    if os.environ.get(LOG_ENV):
        from tests.support import cpu_time

        config.pluginmanager.register(cpu_time, "shardreplay-cpu-time")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """Under pytest-xdist, the controller warms a cold numba cache and bytecode cache before
    the workers start (see :mod:`tests.support.warm`); a run in one process compiles as it goes."""
    config = session.config
    workers = getattr(config.option, "numprocesses", None)
    if workers and not hasattr(config, "workerinput"):
        warm_caches(config.rootpath)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection() -> Iterator[None]:
    """Collect with the cyclic garbage collector paused, then freeze what was imported:
    importing the test modules (torch, scipy, ...) allocates objects by the hundred
    thousand and none is garbage, and the tests' own collections then skip them (as the
    learners' fork server does: :mod:`shardreplay.runtime.launch.learner_preload`)."""
    with collector_paused():
        yield


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start redis servers (``appendonly=...``, ``password=...``); all are stopped after the test."""
    servers: list[RedisServer] = []

    def make(*, appendonly: bool = False, password: str | None = None) -> RedisServer:
        return start_redis(tmp_path / f"redis{len(servers)}", appendonly=appendonly, password=password,
                           started=servers)

    try:
        yield make
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def redis_server(redis_factory: Callable[..., RedisServer]) -> RedisServer:
    """A fresh redis-server without persistence (``--save "" --appendonly no``)."""
    return redis_factory()


# The files whose tests take minutes, the longest single tests first (CPU-seconds measured
# with SHARDREPLAY_CPU_LOG, see tests/support/cpu_time.py: three hosts 212, the fault matrix
# 173 and 96, the signal chains 128 and 102, the layouts 115, 90, 51, the evidence 97): run
# first, so that under pytest-xdist the longest tests start at once and the short ones fill
# the other workers around them, instead of one long test ending the run alone.
HEAVY_FIRST = (
    "tests/runtime/launch/test_three_hosts.py",
    "tests/runtime/launch/test_e2e_faults.py",
    "tests/runtime/launch/test_train_signals.py",
    "tests/runtime/launch/test_train_layouts.py",
    "tests/runtime/launch/test_train_evidence.py",
)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Skip the tests marked ``cuda`` where no GPU is. Mark every ``distributed`` test
    ``slow`` as well: each starts processes that import
    torch and form a gloo group (tens of seconds on 2 cores), so ``make test-fast``
    (``-m "not slow"``) leaves them to ``make test``. Then put the files of
    :data:`HEAVY_FIRST` first (a stable sort: the same order on every xdist worker)."""
    for item in items:
        if item.get_closest_marker("distributed") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
    if any(item.get_closest_marker("cuda") is not None for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (benchmarks/gpu_check.sh runs these on a GPU)")
        for item in items:
            if item.get_closest_marker("cuda") is not None:
                item.add_marker(skip)
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
