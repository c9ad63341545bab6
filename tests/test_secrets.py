"""Redis passwords are used to connect and never shown: redaction, adoption, the file,
the environment, and a real password-protected redis-server."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from shardreplay import secrets
from shardreplay.errors import ConfigError, TransportError
from shardreplay.runtime.log_lines import LineSafeHandler
from shardreplay.transport.redis import RedisLink, check_reachable

SECRET = "s3cr3t-Pa55"


@pytest.fixture(autouse=True)
def _no_password(monkeypatch: pytest.MonkeyPatch) -> None:
    # Set, then delete: monkeypatch restores the variable's absence after the test, also
    # when the code under test (adopt, read_password_file) sets it itself.
    monkeypatch.setenv(secrets.ENV, "")
    monkeypatch.delenv(secrets.ENV)


@pytest.mark.parametrize(("url", "shown"), [
    (f"redis://:{SECRET}@h:6379/0", "redis://:***@h:6379/0"),
    (f"rediss://alice:{SECRET}@h:6380/2", "rediss://alice:***@h:6380/2"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("redis://alice@h:6379/0", "redis://alice@h:6379/0"),
    ("file:///tmp/spool", "file:///tmp/spool"),
    ("local", "local"),
])
def test_redact_shows_no_password(url: str, shown: str) -> None:
    assert secrets.redact(url) == shown
    assert SECRET not in secrets.redact(url)


def test_adopt_moves_the_password_into_the_environment_once() -> None:
    import os

    assert secrets.adopt(f"redis://:{SECRET}@h:1/0") == "redis://:***@h:1/0"
    assert os.environ[secrets.ENV] == SECRET
    assert secrets.adopt(f"redis://:{SECRET}@other:2/0") == "redis://:***@other:2/0"  # the same one: fine
    with pytest.raises(ConfigError, match="differs"):
        secrets.adopt("redis://:another@h:1/0")
    assert secrets.connect_args("redis://:***@h:1/0") == ("redis://h:1/0", SECRET)


def test_a_redacted_url_without_a_password_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"set \\${secrets.ENV} or pass --redis-password-file"):
        secrets.connect_args("redis://:***@h:1/0")
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        secrets.read_password_file(str(empty))
    with pytest.raises(ConfigError, match="No such file"):
        secrets.read_password_file(str(tmp_path / "missing"))
    good = tmp_path / "pw"
    good.write_text(SECRET + "\n")
    secrets.read_password_file(str(good))
    assert secrets.connect_args("redis://:***@h:1/0") == ("redis://h:1/0", SECRET)


def test_log_lines_never_show_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(secrets.ENV, SECRET)
    handler = LineSafeHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "connecting to redis://:%s@h/0",
                               (SECRET,), None)
    assert handler.format(record) == "connecting to redis://:***@h/0"


@pytest.mark.redis
def test_a_protected_server_is_reached_from_each_source_and_named_without_it(
        redis_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = redis_factory(password=SECRET)
    bare = f"redis://127.0.0.1:{server.port}/0"
    with pytest.raises(TransportError) as refused:  # no password anywhere: refused, and said so
        check_reachable(bare, 2.0)
    assert "127.0.0.1" in str(refused.value) and SECRET not in str(refused.value)
    link = RedisLink(f"redis://:{SECRET}@127.0.0.1:{server.port}/0")  # in the URL
    assert link.call(lambda c: c.ping(), what="ping", deadline=None) and SECRET not in link.url
    link.close()
    monkeypatch.setenv(secrets.ENV, SECRET)  # from the environment, for the redacted URL
    for url in (bare, f"redis://:***@127.0.0.1:{server.port}/0"):
        link = RedisLink(url)
        assert link.call(lambda c: c.ping(), what="ping", deadline=None)
        link.close()
