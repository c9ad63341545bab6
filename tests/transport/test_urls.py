"""The query options shardreplay reads itself (the policy ``key``) and a named run's keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardreplay.errors import ConfigError
from shardreplay.policy.factory import _redis_options
from shardreplay.runtime.run_identity import upcoming_life, write_life
from shardreplay.runtime.settings import TrainSettings
from shardreplay.transport.urls import pop_query, with_policy_key


def test_the_policy_key_rides_in_the_url_and_the_rest_goes_to_redis_py() -> None:
    url = "rediss://h:6380/0?ssl_ca_certs=/etc/ca.pem"
    keyed = with_policy_key(url, "shardreplay:run-a:policy")
    assert keyed == "rediss://h:6380/0?ssl_ca_certs=/etc/ca.pem&key=shardreplay:run-a:policy"
    assert pop_query(keyed, "key") == (url, "shardreplay:run-a:policy")
    assert _redis_options(keyed, {}) == (url, {"key": "shardreplay:run-a:policy"})
    assert _redis_options(keyed, {"key": "given"}) == (url, {"key": "given"})  # an explicit one wins
    assert pop_query("redis://h/0", "key") == ("redis://h/0", None)


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
