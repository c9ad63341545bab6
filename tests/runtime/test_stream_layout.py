"""Every shard is fed: streams (actor x env) spread over the learner shards.

Properties over random numbers of actors, envs per actor and shards: each stream has
exactly one shard and one row there; a shard's rows are ``0 .. streams_of_shard - 1``,
each used once; no shard is empty whenever there are at least as many streams as
shards; whole actors stay together when there are at least as many actors as shards,
and otherwise shards differ by at most one row. Fewer streams than shards is refused
in one line, by the layout and by ``TrainSettings``.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardreplay.errors import ConfigError
from shardreplay.runtime.settings import TrainSettings
from shardreplay.runtime.stream_layout import MAX_SHARDS, SHARD_SEQUENCE_SHIFT, StreamLayout


def _table(layout: StreamLayout) -> tuple[np.ndarray, np.ndarray]:
    """Shard and row of every (actor, env), ``[A, E]`` each."""
    e = layout.envs_per_actor
    shards = np.stack([layout.shards(a) for a in range(layout.num_actors)])
    rows = np.stack([layout.rows(a, np.arange(e)) for a in range(layout.num_actors)])
    return shards, rows


@settings(max_examples=300, deadline=None, derandomize=True)
@given(actors=st.integers(1, 12), envs=st.integers(1, 6), shards=st.integers(1, 16))
def test_every_stream_has_one_row_of_one_shard_and_every_shard_is_fed(actors: int, envs: int,
                                                                      shards: int) -> None:
    if actors * envs < shards:
        with pytest.raises(ConfigError, match=f"--learners {shards} needs at least {shards} streams"):
            StreamLayout(actors, envs, shards)
        return
    layout = StreamLayout(actors, envs, shards)
    shard_of, row_of = _table(layout)
    sizes = [layout.streams_of_shard(k) for k in range(shards)]
    assert min(sizes) >= 1 and sum(sizes) == actors * envs  # every shard fed, no stream lost
    for k in range(shards):  # a shard's rows are exactly 0..n-1, each once
        assert sorted(row_of[shard_of == k].tolist()) == list(range(sizes[k]))
        assert layout.actors_of_shard(k) == int((shard_of == k).any(axis=1).sum())
    for a in range(actors):
        groups = layout.groups(a)
        assert sorted(np.concatenate(list(groups.values())).tolist()) == list(range(envs))
        assert all((shard_of[a, g] == k).all() for k, g in groups.items())
        assert layout.home_shard(a) == shard_of[a, 0]
    if actors >= shards:  # whole actors: one shard each, as evenly as actors allow
        assert (shard_of == shard_of[:, :1]).all()
        assert max(sizes) - min(sizes) <= envs
    else:  # split streams: contiguous blocks differing by at most one row
        assert max(sizes) - min(sizes) <= 1
        assert (np.diff(shard_of.reshape(-1)) >= 0).all()


def test_the_layouts_of_the_issue_feed_every_shard() -> None:
    """``train --learners 3 --actors 2`` (4 envs): shard 2 held nothing for the whole run."""
    layout = StreamLayout(2, 4, 3)
    assert [layout.streams_of_shard(k) for k in range(3)] == [3, 3, 2]
    assert {a: sorted(layout.groups(a)) for a in range(2)} == {0: [0, 1], 1: [1, 2]}
    four = StreamLayout(4, 4, 3)  # whole actors: 0 and 3 on shard 0
    assert [four.streams_of_shard(k) for k in range(3)] == [8, 4, 4]


def test_fewer_streams_than_learners_is_one_config_error() -> None:
    with pytest.raises(ConfigError, match="actors x envs-per-actor = 1 x 2 = 2"):
        TrainSettings.from_dict(dict(learners=3, actors=1, envs_per_actor=2))
    TrainSettings.from_dict(dict(learners=3, actors=1, envs_per_actor=3))  # exactly enough
    with pytest.raises(ConfigError):
        StreamLayout(2, 2, 0)


def test_the_sequences_an_actor_sends_to_different_shards_never_meet() -> None:
    clock = 1_800_000_000_000_000  # microseconds: the year 2027
    per_shard = [(k << SHARD_SEQUENCE_SHIFT) + clock + np.arange(10**6) for k in range(3)]
    assert all(a.max() < b.min() for a, b in itertools.pairwise(per_shard))
    assert (MAX_SHARDS << SHARD_SEQUENCE_SHIFT) + 2 * clock < 2**63  # until about 2110


def test_an_actor_the_routing_no_longer_runs_stands_in_for_an_actor_it_runs() -> None:
    layout = StreamLayout(3, 2, 2)  # 3 actors now; an earlier life had more
    assert [layout.stand_in(a) for a in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert StreamLayout(0, 2, 1).stand_in(4) is None
