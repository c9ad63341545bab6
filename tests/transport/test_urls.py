"""The query options shardreplay reads itself (the policy ``key``) and a named run's keys."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from shardreplay.errors import ConfigError
from shardreplay.policy import open_publisher
from shardreplay.runtime.run_identity import upcoming_life, write_life
from shardreplay.runtime.settings import TrainSettings
from shardreplay.transport.urls import file_url, parse_medium, pop_query, with_policy_key
from tests.transport.transport_helpers import SPEC


def test_the_policy_key_rides_in_the_url_and_the_rest_goes_to_redis_py(redis_server) -> None:
    url = "rediss://h:6380/0?ssl_ca_certs=/etc/ca.pem"
    keyed = with_policy_key(url, "shardreplay:run-a:policy")
    assert keyed == "rediss://h:6380/0?ssl_ca_certs=/etc/ca.pem&key=shardreplay:run-a:policy"
    assert pop_query(keyed, "key") == (url, "shardreplay:run-a:policy")
    assert pop_query("redis://h/0", "key") == ("redis://h/0", None)
    import redis

    keyed = with_policy_key(redis_server.url, "run-a:policy")
    for publisher in (open_publisher(keyed), open_publisher(keyed, key="given")):  # an explicit one wins
        publisher.publish(1, {"w": np.zeros(1)})
        publisher.close()
    assert set(redis.Redis.from_url(redis_server.url).keys()) == {b"run-a:policy", b"given"}


def test_a_named_run_publishes_under_its_own_key(tmp_path: Path) -> None:
    s = TrainSettings.from_dict(dict(transport="redis://h:6379/0", run_id="run-a")).with_run_dir(tmp_path)
    assert s.transport.policy_url == "redis://h:6379/0?key=shardreplay:run-a:policy"
    unnamed = TrainSettings.from_dict(dict(transport="redis://h:6379/0")).with_run_dir(tmp_path)
    assert unnamed.transport.policy_url == "redis://h:6379/0"  # as before: shardreplay:policy
    with pytest.raises(ConfigError, match="run id"):
        TrainSettings.from_dict(dict(run_id="no spaces"))


def test_the_first_start_takes_the_given_run_id_and_later_ones_keep_it(tmp_path: Path) -> None:
    first = upcoming_life(tmp_path, "run-a")
    assert (first.run_id, first.life) == ("run-a", 0)
    write_life(tmp_path, first, {})
    assert upcoming_life(tmp_path, "run-a").life == 1 and upcoming_life(tmp_path).run_id == "run-a"
    with pytest.raises(ConfigError, match="names another run"):
        upcoming_life(tmp_path, "run-b")


@pytest.mark.parametrize(("url", "kind", "path"), [
    ("", "local", ""), ("local", "local", ""), ("local://", "local", ""),
    ("file:///data/spool", "file", "/data/spool"), ("file://localhost/data", "file", "/data"),
    ("file:///a b/c", "file", "/a b/c"),
    ("redis://h:6379/0", "redis", ""), ("rediss://:pw@h:6380/0?ssl_ca_certs=/ca.pem", "redis", ""),
    ("unix:///run/redis.sock?db=1", "redis", ""),
])
def test_one_parser_takes_every_medium_url(url: str, kind: str, path: str) -> None:
    medium = parse_medium(url)
    assert (medium.kind, medium.url, medium.path) == (kind, url, path)


@pytest.mark.parametrize(("url", "kinds", "message"), [
    ("ftp://host/dir", ("local", "file", "redis"),
     "unknown transport URL 'ftp://host/dir': use 'local', 'file:///dir' or 'redis://host:port/db'"),
    ("/data/spool", ("local", "file", "redis"), "use 'local', 'file:///dir' or 'redis://host:port/db'"),
    ("file://host/dir", ("local", "file", "redis"), "transport needs file:///absolute/dir"),
    ("file://", ("local", "file", "redis"), "transport needs file:///absolute/dir"),
    ("local", ("file", "redis"), "use 'file:///dir' or 'redis://host:port/db'"),
    ("http://h/", ("redis",), "use 'redis://host:port/db'"),
])
def test_one_parser_refuses_with_the_accepted_forms(url: str, kinds: tuple, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_medium(url, kinds=kinds)


def test_every_caller_refuses_through_the_one_parser() -> None:
    from shardreplay.policy import open_subscriber
    from shardreplay.transport import open_transport

    with pytest.raises(ConfigError, match=re.escape("use 'local', 'file:///dir' or 'redis://host:port/db'")):
        open_transport("ftp://x", SPEC)
    with pytest.raises(ConfigError, match=re.escape("unknown policy broadcast URL 'local': use 'file:///dir'")):
        open_subscriber("local")
    with pytest.raises(ConfigError, match="unknown transport URL"):
        parse_medium("gopher://x")
    assert file_url("/a b/policy") == "file:///a b/policy" and parse_medium(file_url("/a b")).path == "/a b"
