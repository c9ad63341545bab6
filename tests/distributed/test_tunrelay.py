"""The TUN relay (``benchmarks/net/tunrelay.py``, netem's delay in a process): packets arrive
unchanged, each once, in order, each at least the asked delay late; the relay and its
devices are gone when the link is closed, also after an error in the block.

Needs root and TUN devices (skipped, saying why, elsewhere).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import linkprobe
import netns
import pytest


@pytest.fixture(scope="module", autouse=True)
def _tun() -> None:
    why = netns.tun_unavailable()
    if why:
        pytest.skip(f"the TUN relay cannot run here: {why}")


def _relays_of(namespace: str) -> list[int]:
    """Ids of the running relay processes of ``namespace``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or it ended meanwhile
            continue
        if any(a.endswith(b"tunrelay.py") for a in args) and namespace.encode() in args:
            found.append(int(entry.name))
    return found


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("delay_ms", [0.0, 2.0])
def test_datagrams_cross_unchanged_in_order_and_late_by_the_delay(delay_ms: float) -> None:
    with netns.delayed_link(delay_ms, kind="tun-relay") as link:
        assert (link.delay_kind, link.delay_ms) == ("tun-relay", delay_ms)
        assert _relays_of(link.namespaces[0]) == [link.relay_pid]
        got = linkprobe.datagrams(link, count=300)
    assert got["received"] == 600, got  # both ways, none lost, changed or out of order
    assert got["one_way_ms_min"] >= delay_ms, got
    assert got["one_way_ms_median"] < delay_ms + 100, got


def test_a_tcp_round_trip_takes_twice_the_delay() -> None:
    with netns.delayed_link(0.5, kind="tun-relay") as link:
        rtt = linkprobe.rtt_ms(link, count=100)
    assert 1.0 <= rtt["min"] <= rtt["median"] < 100, rtt


def test_the_relay_and_the_namespaces_end_with_the_block_even_after_an_error() -> None:
    with pytest.raises(KeyError), netns.delayed_link(0.25, kind="tun-relay") as link:
        assert _relays_of(link.namespaces[0]) == [link.relay_pid]
        raise KeyError("boom")
    assert _relays_of(link.namespaces[0]) == []
    assert link.namespaces[0] not in _namespaces() and link.namespaces[1] not in _namespaces()


def test_a_bad_kind_or_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="kind"), netns.delayed_link(1.0, kind="wire"):
        pass
    with pytest.raises(ValueError, match="delay_ms"), netns.delayed_link(-1.0):
        pass


def test_the_relay_dies_with_a_killed_caller() -> None:
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); import netns\n"
            "with netns.delayed_link(1.0, kind='tun-relay') as link:\n"
            "    print(link.namespaces[0], link.namespaces[1], flush=True); time.sleep(60)\n")
    caller = subprocess.Popen([sys.executable, "-c", code, str(netns._RELAY.parent)], stdout=subprocess.PIPE,
                              text=True)
    namespaces = []
    try:
        assert caller.stdout is not None
        namespaces = caller.stdout.readline().split()
        assert len(namespaces) == 2 and len(_relays_of(namespaces[0])) == 1
        caller.kill()
        caller.wait(10)
        deadline = time.monotonic() + 10
        while _relays_of(namespaces[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _relays_of(namespaces[0]) == []
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
        for name in namespaces:  # a killed caller cannot remove its namespaces
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
