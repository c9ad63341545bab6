"""Policy broadcast over files and a real redis-server: atomic, versioned, loaded only on change."""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shardreplay.errors import ConfigError, TransportTimeout
from shardreplay.policy import open_publisher, open_subscriber, wait_for_policy
from shardreplay.policy.file_backend import NOTE, weights_name


def weights(version: int) -> dict[str, torch.Tensor]:
    """Weights whose every value is the version: a torn read would show."""
    return {"layer.weight": torch.full((64, 32), float(version)),
            "layer.bias": torch.full((32,), float(version), dtype=torch.bfloat16),
            "steps": torch.tensor(version, dtype=torch.int64)}


def assert_consistent(update) -> None:
    for name, value in update.weights.items():
        assert (value.float() == update.version).all(), name


def publish_many(url: str, count: int, held: tuple[int, ...], taken: Any) -> None:
    """Child-process body: publish versions 1..count as fast as possible, except that each
    version in ``held`` stays the newest until the subscriber took it (``taken``: the
    newest version it loaded): however the two processes are scheduled, reading overlaps
    publishing. Exits with an error when the subscriber never takes one."""
    publisher = open_publisher(url)
    for v in range(1, count + 1):
        publisher.publish(v, weights(v))
        deadline = time.monotonic() + 60
        while v in held and taken.value < v:
            if time.monotonic() > deadline:
                raise SystemExit(f"the subscriber never took version {v}")
            time.sleep(0.001)
    publisher.close()


@pytest.fixture(params=["file", "redis"])
def url(request, tmp_path: Path) -> str:
    if request.param == "file":
        return (tmp_path / "policy").absolute().as_uri()
    return request.getfixturevalue("redis_server").url


def test_poll_loads_only_when_the_version_changes(url: str) -> None:
    publisher = open_publisher(url)
    subscriber = open_subscriber(url, check_interval_s=0)
    assert subscriber.poll() is None and subscriber.version is None
    publisher.publish(3, weights(3))
    update = subscriber.poll()
    assert update is not None and update.version == 3 and subscriber.version == 3
    assert_consistent(update)
    assert update.weights["layer.bias"].dtype == torch.bfloat16
    for _ in range(5):
        assert subscriber.poll() is None
    assert subscriber.stats.loads == 1 and subscriber.stats.checks >= 6
    publisher.publish(4, weights(4))
    assert subscriber.poll().version == 4
    late = open_subscriber(url, check_interval_s=0)  # a late subscriber finds the current policy
    assert late.poll().version == 4
    with pytest.raises(ConfigError, match="does not increase"):
        publisher.publish(4, weights(4))
    with pytest.raises(ConfigError, match="not a tensor"):
        publisher.publish(5, {"w": [1.0, 2.0]})
    publisher.publish(9, {"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
    np.testing.assert_array_equal(subscriber.poll().weights["w"].numpy(), np.arange(6).reshape(2, 3))
    publisher.close()
    subscriber.close()


def test_checks_are_rate_limited(url: str) -> None:
    publisher = open_publisher(url)
    subscriber = open_subscriber(url, check_interval_s=30)
    assert subscriber.poll() is None  # first check: nothing yet
    publisher.publish(1, weights(1))
    if url.startswith("file"):
        assert subscriber.poll() is None  # no hints for files: waits for the interval
        assert subscriber.stats.checks == 1
    assert wait_for_policy(subscriber, timeout_s=10).version == 1


def test_wait_for_policy_times_out_with_a_clear_error(url: str) -> None:
    subscriber = open_subscriber(url, check_interval_s=0)
    with pytest.raises(TransportTimeout, match="has the learner published"):
        wait_for_policy(subscriber, timeout_s=0.2)


@pytest.mark.slow
def test_concurrent_publishing_never_shows_a_torn_policy(url: str) -> None:
    # The publisher pauses at these versions until they are seen: on a loaded machine it
    # could otherwise publish all 150 before this process polls once.
    held = tuple(range(1, 150, 25))
    ctx = mp.get_context("spawn")
    taken = ctx.Value("q", 0)
    proc = ctx.Process(target=publish_many, args=(url, 150, held, taken))
    proc.start()
    seen: list[int] = []
    subscriber = open_subscriber(url, check_interval_s=0)
    try:
        deadline = time.monotonic() + 120
        while not seen or seen[-1] < 150:
            alive = proc.is_alive()  # before the poll: a dead publisher's last version is still seen
            update = subscriber.poll()
            if update is not None:
                assert_consistent(update)
                seen.append(update.version)
                taken.value = update.version
            elif not alive or time.monotonic() > deadline:
                break
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert proc.exitcode == 0
    assert seen[-1] == 150 and seen == sorted(set(seen))
    assert set(held) <= set(seen), "the subscriber missed a version the publisher held for it"
    assert subscriber.stats.rejected == {}
    assert subscriber.stats.loads == len(seen)


def test_damaged_file_is_rejected_once_and_the_old_policy_kept(tmp_path: Path) -> None:
    url = tmp_path.absolute().as_uri()
    publisher = open_publisher(url, keep=2)
    subscriber = open_subscriber(url, check_interval_s=0)
    publisher.publish(1, weights(1))
    assert subscriber.poll().version == 1
    publisher.publish(2, weights(2))
    victim = tmp_path / weights_name(2)
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(data)
    assert subscriber.poll() is None and subscriber.poll() is None
    assert subscriber.stats.rejected == {"checksum": 1} and subscriber.version == 1
    (tmp_path / NOTE).write_text("{not json")
    assert subscriber.poll() is None
    assert subscriber.stats.rejected == {"checksum": 1, "format": 1}
    publisher.publish(3, weights(3))
    assert subscriber.poll().version == 3
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [weights_name(2), weights_name(3)]
    assert json.loads((tmp_path / NOTE).read_text())["version"] == 3


@pytest.mark.redis
def test_redis_hint_wakes_a_pausing_subscriber_and_lost_hints_cost_one_interval(redis_server) -> None:
    import redis

    publisher = open_publisher(redis_server.url)
    subscriber = open_subscriber(redis_server.url, check_interval_s=0.5)
    assert subscriber.poll() is None
    subscriber.pause(0.01)  # subscribed now
    timer = threading.Timer(0.2, lambda: publisher.publish(1, weights(1)))
    timer.start()
    t0 = time.monotonic()
    subscriber.pause(5.0)
    assert time.monotonic() - t0 < 2.0  # woken by the hint, not the timeout
    assert subscriber.poll().version == 1
    timer.join()
    raw = redis.Redis.from_url(redis_server.url)
    other = open_publisher(redis_server.url, key="scratch")
    other.publish(2, weights(2))
    raw.hset("shardreplay:policy", mapping=raw.hgetall("scratch"))  # a publish whose hint is lost
    t1 = time.monotonic()
    update = None
    while update is None and time.monotonic() < t1 + 5:
        update = subscriber.poll()
        time.sleep(0.01)
    assert update is not None and update.version == 2
    assert time.monotonic() - t1 < 0.5 + 0.3  # found by the periodic check
    raw.hset("shardreplay:policy", mapping={"version": "3", "crc32": "1", "weights": b"junk"})
    time.sleep(0.6)
    assert subscriber.poll() is None and subscriber.version == 2
    assert subscriber.stats.rejected == {"checksum": 1}
