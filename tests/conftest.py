"""Shared fixtures: a real redis-server on a free loopback port, stopped after the test.
Tests on real torch.distributed groups also count as slow (see the hook below)."""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM if pytest dies, so no redis-server outlives a run."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class RedisServer:
    """A redis-server child process in its own directory.

    Args:
        workdir: where the server keeps its files (AOF when ``appendonly``).
        appendonly: persist every write (for restart tests); else nothing is saved.
        password: require this password (``--requirepass``); None: none.
    """

    def __init__(self, workdir: Path, *, appendonly: bool = False, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: `apt-get install -y redis-server` "
                        "(make test installs it)")
        self.binary = binary
        self.workdir = workdir
        self.appendonly = appendonly
        self.password = password
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> None:
        """Start the server and wait until it answers PING."""
        import redis  # only the redis tests need it

        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
                "--dir", str(self.workdir), "--daemonize", "no", "--protected-mode", "yes",
                *(["--requirepass", self.password] if self.password else [])]
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 (closed with the process)
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent)
        log.close()
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1, socket_connect_timeout=1,
                             password=self.password)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited: {(self.workdir / 'redis.log').read_text()}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not answer PING in time")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """SIGTERM (the server saves its AOF and exits), SIGKILL if it hangs; reaped."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        """Stop, stay down ``down_s`` seconds, start again on the same port and directory."""
        self.stop()
        time.sleep(down_s)
        self.start()


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start redis servers (``appendonly=...``, ``password=...``); all are stopped after the test."""
    servers: list[RedisServer] = []

    def make(*, appendonly: bool = False, password: str | None = None) -> RedisServer:
        workdir = tmp_path / f"redis{len(servers)}"
        workdir.mkdir()
        for _ in range(5):  # the free port may be taken between probe and bind
            server = RedisServer(workdir, appendonly=appendonly, password=password)
            servers.append(server)
            try:
                server.start()
                return server
            except RuntimeError:
                server.stop()
        raise RuntimeError("could not start redis-server on a free port")

    try:
        yield make
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def redis_server(redis_factory: Callable[..., RedisServer]) -> RedisServer:
    """A fresh redis-server without persistence (``--save "" --appendonly no``)."""
    return redis_factory()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every ``distributed`` test ``slow`` as well: each starts processes that import
    torch and form a gloo group (tens of seconds on 2 cores), so ``make test-fast``
    (``-m "not slow"``) leaves them to ``make test``."""
    for item in items:
        if item.get_closest_marker("distributed") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
