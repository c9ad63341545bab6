"""A real redis-server child process on a free loopback port of this worker's own."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from shardreplay._signals import die_with_parent
from tests.support.ports import free_port


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
        self.port = free_port()
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
                                     preexec_fn=die_with_parent)  # SIGTERM if pytest dies
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


def start_redis(workdir: Path, *, appendonly: bool = False, password: str | None = None,
                started: list[RedisServer] | None = None) -> RedisServer:
    """A started :class:`RedisServer` in ``workdir`` (created), appended to ``started`` (so that
    the caller stops it even when a later try fails); a port taken between probe and bind
    is retried on another.

    Raises:
        RuntimeError: five ports in a row failed.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    started = [] if started is None else started
    for _ in range(5):
        server = RedisServer(workdir, appendonly=appendonly, password=password)
        started.append(server)
        try:
            server.start()
            return server
        except RuntimeError:
            server.stop()
    raise RuntimeError("could not start redis-server on a free port")
