"""A run over a password-protected Redis never writes the password down.

``train --transport redis://:PASSWORD@host/0`` runs to its end; then every file of the
run directory, the run's own output and every key and value in Redis are searched for
the password: none holds it (config.json shows ``redis://:***@...``). A resume, which
reads the redacted URL back, needs the password again: without it, one line says where
to give it; with ``--redis-password-file`` it continues.
"""

from __future__ import annotations

import json
import secrets as pysecrets
from pathlib import Path

import pytest
import redis

from shardreplay.secrets import ENV
from tests.support.train_runs import FAST, TrainRun

pytestmark = [pytest.mark.slow, pytest.mark.redis]


def _redis_holds(client: redis.Redis, needle: bytes) -> list[str]:
    """Keys whose name or value contains ``needle``."""
    found = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key).decode()
        if kind == "string":
            values = [client.get(key) or b""]
        elif kind == "stream":
            values = [b"".join(k + v for k, v in fields.items()) for _id, fields in client.xrange(key)]
        elif kind == "hash":
            values = [k + v for k, v in client.hgetall(key).items()]
        elif kind == "list":
            values = client.lrange(key, 0, -1)
        elif kind in ("set", "zset"):
            values = list(client.smembers(key)) if kind == "set" else client.zrange(key, 0, -1)
        else:
            values = [client.dump(key) or b""]
        if needle in key or any(needle in v for v in values):
            found.append(key.decode())
    return found


def _files_holding(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


@pytest.mark.timeout(600)
def test_a_password_given_in_the_url_is_nowhere_in_the_run(tmp_path: Path, redis_factory,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "")
    monkeypatch.delenv(ENV)  # restored to absent after the test
    password = "pw-" + pysecrets.token_hex(12)
    server = redis_factory(password=password)
    run_dir = tmp_path / "run"
    args = [*FAST, "--learners", "1", "--actors", "1", "--hidden", "16", "--total-env-steps", "600",
            "--checkpoint-interval-updates", "100"]
    url = f"redis://:{password}@127.0.0.1:{server.port}/0"
    with TrainRun(["train", "--run-dir", str(run_dir), "--transport", url, *args], tmp_path / "first") as run:
        assert run.wait(300) == 0, run.explain()
        assert run.leftovers() == [], run.explain()
        output = run.stdout() + run.stderr()
    needle = password.encode()
    assert password not in output
    assert _files_holding(run_dir, needle) == []
    client = redis.Redis(host="127.0.0.1", port=server.port, password=password)
    try:
        assert client.dbsize() > 0  # the run used it (chunks, policy)
        assert _redis_holds(client, needle) == []
    finally:
        client.close()
    config = json.loads((run_dir / "config.json").read_text())
    assert config["transport"]["url"] == f"redis://:***@127.0.0.1:{server.port}/0"

    # A resume reads the redacted URL back: without the password, one line says what to do.
    with TrainRun(["train", "--resume", str(run_dir), "--total-env-steps", "1200"], tmp_path / "nopw") as run:
        assert run.wait(60) == 2, run.explain()
        lines = run.stderr().strip().splitlines()
        assert len(lines) == 1 and ENV in lines[0] and "--redis-password-file" in lines[0], lines
    secret_file = tmp_path / "redis-password"
    secret_file.write_text(password + "\n")
    with TrainRun(["train", "--resume", str(run_dir), "--total-env-steps", "1200", "--redis-password-file",
                   str(secret_file)], tmp_path / "file") as run:
        assert run.wait(300) == 0, run.explain()
        assert password not in run.stdout() + run.stderr()
    assert _files_holding(run_dir, needle) == []
