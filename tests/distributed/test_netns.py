"""Sharded sampling between two network namespaces joined by a veth pair (two hosts' worth
of TCP stack, not loopback), with a ``tc netem`` delay where the kernel has netem.

Runs the strict checks of :mod:`test_sharded_distribution` and the pipelined checks of
:mod:`test_sharded_pipeline` (K = 2, records through the link, not shared memory) with each
rank in its own namespace and under its own host name, so sampled records cross the link
(not shared memory). Skipped, saying why, where namespaces cannot be made (not root, no
``ip``); without netem it runs with no delay (the fixture prints why).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import test_sharded_distribution as strict
import test_sharded_pipeline as pipelined
from harness import run_ranks
from sharded_reference import Reference

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import netns

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
DELAY_MS = 0.25


@pytest.fixture(scope="module")
def link():
    why = netns.unavailable()
    if why:
        pytest.skip(f"no network namespaces here: {why}")
    with netns.veth_pair(DELAY_MS) as live:
        if live.netem_error:
            print(f"netem unavailable, running without delay: {live.netem_error}")
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


def test_the_link_is_not_loopback(link: netns.Link) -> None:
    assert link.addresses[0] != "127.0.0.1" and link.namespaces[0] != link.namespaces[1]
    assert link.delay_ms in (0.0, DELAY_MS)
    assert (link.delay_ms == 0.0) == bool(link.netem_error)
