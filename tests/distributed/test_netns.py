"""Sharded sampling between two network namespaces joined by a link with 1 ms of delay each
way (two hosts' worth of TCP stack, not loopback): ``tc netem`` on a veth pair where the
kernel has netem, else the TUN relay of ``benchmarks/net/tunrelay.py``.

Runs the strict checks of :mod:`test_sharded_distribution` and the pipelined checks of
:mod:`test_sharded_pipeline` (K = 2) with each rank in its own namespace and under its own
host name, so sampled records cross the link (not shared memory). The delay is measured, not
trusted: a TCP round trip over the link must take at least twice it. Skipped, saying why,
where namespaces cannot be made (not root, no ``ip``) or no delay can be put on the link
(neither netem nor TUN devices).
"""

from __future__ import annotations

import os
from pathlib import Path

import linkprobe
import netns
import numpy as np
import pytest

from tests.distributed import test_sharded_distribution as strict
from tests.distributed import test_sharded_pipeline as pipelined
from tests.distributed.sharded_reference import Reference
from tests.support import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
DELAY_MS = 1.0


@pytest.fixture(scope="module")
def link():
    why = netns.unavailable()
    if why:
        pytest.skip(f"no network namespaces here: {why}")
    why_tun = netns.tun_unavailable()
    with netns.delayed_link(DELAY_MS, kind="netem" if why_tun else "auto") as live:
        if live.delay_kind == "none":
            pytest.skip(f"no way to delay a link here: netem: {live.netem_error}; TUN relay: {why_tun}")
        yield live


def _places(link: netns.Link) -> list[tuple[str, str, str]]:
    return [(link.namespaces[r], link.addresses[0], link.ifnames[r]) for r in range(2)]


def test_strict_sharded_sampling_across_namespaces(link: netns.Link) -> None:
    results = run_ranks(strict._scenario, 2, places=_places(link), port=29_400 + os.getpid() % 500,
                        timeout_s=300)
    world = (2, results, Reference(2, {i for r in results for i in r["updated"]}))
    assert all(r["shared_memory"] is False for r in results)  # records went over the veth
    strict.test_global_sizes_and_empty_buffer(world)
    strict.test_every_rank_issues_the_same_collectives(world)
    strict.test_priority_updates_land_on_the_owner(world)
    for sampler in ("prioritized", "uniform"):
        strict.test_exact_mode_draws_the_single_buffer_distribution(world, sampler)
        strict.test_local_mode_weights_carry_the_shard_factor(world, sampler)


def test_pipelined_sharded_sampling_across_namespaces(link: netns.Link, tmp_path: Path) -> None:
    results = run_ranks(pipelined._scenario, 2, str(tmp_path), places=_places(link),
                        port=29_900 + os.getpid() % 500, timeout_s=300)
    world = (2, results, Reference(2, set()))
    pipelined.test_pipelined_exact_sampling_draws_the_single_buffer_distribution(world)
    pipelined.test_an_update_of_step_t_lands_before_the_draw_of_step_t_plus_2(world)
    pipelined.test_checkpoint_save_and_load_with_a_draw_in_flight(world)
    pipelined.test_an_error_in_one_ranks_exchange_reaches_every_rank(world)


def _flat_and_hierarchical(rank: int, world: int) -> dict:
    from tests.distributed.test_hierarchy import _draws

    return {"flat": _draws(rank, world, False, False, 1),
            "hier": _draws(rank, world, True, False, 1, emulate=False),
            "piped": _draws(rank, world, True, True, 1, emulate=False)}


def test_hierarchical_exchange_across_namespaces() -> None:
    """4 ranks on 2 namespaces (hosts of 2, each under its own host name, an undelayed routed
    network): the exchange group is hierarchical and draws the flat path's batches."""
    why = netns.unavailable()
    if why:
        pytest.skip(f"no network namespaces here: {why}")
    with netns.hosts(2) as hosts:
        places = [(hosts.namespaces[r // 2], hosts.addresses[0], hosts.ifname) for r in range(4)]
        results = run_ranks(_flat_and_hierarchical, 4, places=places, port=29_600 + os.getpid() % 300,
                            timeout_s=300)
    assert all(r["piped"]["hierarchy"] for r in results)
    for rank, r in enumerate(results):
        assert (r["flat"]["hierarchy"], r["hier"]["hierarchy"]) == (False, True), rank
        for name in ("keys", "obs", "weights"):
            for a, b in zip(r["flat"][name], r["hier"][name], strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"rank {rank} {name}")


def test_the_link_is_not_loopback_and_delays_every_round_trip(link: netns.Link) -> None:
    assert link.addresses[0] != "127.0.0.1" and link.namespaces[0] != link.namespaces[1]
    assert (link.delay_kind, link.delay_ms) in (("netem", DELAY_MS), ("tun-relay", DELAY_MS))
    assert (link.delay_kind == "tun-relay") == bool(link.netem_error)
    rtt = linkprobe.rtt_ms(link, count=100)
    assert rtt["min"] >= 2 * DELAY_MS, rtt  # even the fastest round trip waited both ways
    assert rtt["median"] < 2 * DELAY_MS + 100, rtt  # and it is a delay, not a stall
