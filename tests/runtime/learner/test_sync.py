"""The learner ranks' per-iteration sync record: exact integers through the tensor, sums
that are field-wise, and a refusal of tensors of another layout."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from shardreplay.checkpoint.triggers import CheckpointTrigger
from shardreplay.errors import ShardReplayError
from shardreplay.runtime.learner.state import MetricsWindow
from shardreplay.runtime.learner.sync import MAX_UPDATES_PER_ITERATION, LoopSync, RunCounts, minutes_due


def test_round_trip_keeps_64_bit_integers_exact() -> None:
    big = 2**62 + 1  # float64 would round it to 2**62
    sync = LoopSync(steps=big, replay_size=3, stop_votes=0, save_votes=1, lag_sum=big - 7, lag_count=5)
    tensor = sync.to_tensor()
    assert tensor.dtype == torch.int64 and tuple(tensor.shape) == (len(dataclasses.fields(LoopSync)),)
    back = LoopSync.from_tensor(tensor)
    assert back == sync and back.steps == big and back.lag_sum == big - 7


def test_sum_over_ranks_is_field_wise_and_decides_once() -> None:
    ranks = [LoopSync(steps=10, replay_size=100, stop_votes=0, save_votes=0, lag_sum=4, lag_count=2),
             LoopSync(steps=7, replay_size=50, stop_votes=1, save_votes=0, lag_sum=2**60, lag_count=1)]
    # What all_reduce(SUM) does with the ranks' tensors.
    total = LoopSync.from_tensor(torch.stack([r.to_tensor() for r in ranks]).sum(0))
    assert total == LoopSync(steps=17, replay_size=150, stop_votes=1, save_votes=0, lag_sum=4 + 2**60,
                             lag_count=3)
    assert total.should_stop and not total.should_save


def test_the_first_rank_out_of_time_stops_the_run_and_names_the_time_limit() -> None:
    # Rank 0 starts its loop after publishing, later than the others: its clock is behind
    # when rank 1's passes --max-minutes, and the run must still say it ended on time.
    late = [LoopSync(steps=3), LoopSync(steps=4, time_votes=1)]
    total = LoopSync.from_tensor(torch.stack([r.to_tensor() for r in late]).sum(0))
    assert total.should_stop and total.time_votes == 1 and total.stop_votes == 0
    assert not LoopSync(steps=3).should_stop


def test_the_run_stops_when_every_actor_gave_up_unless_remote_actors_may_send() -> None:
    ranks = [LoopSync(live_actors=0, actors_given_up=1), LoopSync(live_actors=0, actors_given_up=1)]
    total = LoopSync.from_tensor(torch.stack([r.to_tensor() for r in ranks]).sum(0))
    assert total.actors_gone(remote=0)
    assert not total.actors_gone(remote=2)  # actors started elsewhere: the learners wait for them
    one_left = LoopSync.from_tensor(total.to_tensor() + LoopSync(live_actors=1).to_tensor())
    assert not one_left.actors_gone(remote=0)
    assert not LoopSync().actors_gone(remote=0)  # no actor started (--offline, or stopped while starting)


@pytest.mark.parametrize("tensor", [torch.zeros(10, dtype=torch.float64), torch.zeros(7, dtype=torch.int64),
                                    torch.zeros(2, 10, dtype=torch.int64)])
def test_other_layouts_are_refused(tensor: torch.Tensor) -> None:
    with pytest.raises(ShardReplayError, match="int64 vector of 10"):
        LoopSync.from_tensor(tensor)


def test_metrics_window_counts_syncs_and_resets() -> None:
    window = MetricsWindow(t=5.0)
    window.count(LoopSync(steps=8, lag_sum=6, lag_count=3))
    window.count(LoopSync(steps=2, lag_sum=1, lag_count=1))
    window.updates, window.loss = 4, 0.5
    assert (window.steps, window.lag_sum, window.lag_n) == (10, 7, 4)
    window.reset(9.0)
    assert (window.steps, window.updates, window.lag_sum, window.lag_n, window.t) == (0, 0, 0, 0, 9.0)
    assert window.loss == 0.5  # the last loss stays until a new one


def test_run_counts_name_their_fields() -> None:
    counts = RunCounts(actor_restarts=1, actors_given_up=2, chunks_rejected=3, chunks_duplicate=4,
                       foreign_chunks_ignored=5, ingest_log_replayed=6, ingest_log_rerouted=10,
                       ingest_log_torn=7, ingest_log_peak_bytes=8, ingest_log_bytes=9,
                       rollouts_dropped_segments=11, dataset_steps=12)
    assert list(counts.as_dict().values()) == [1, 2, 3, 4, 5, 6, 10, 7, 8, 9, 11, 12]
    assert set(counts.as_dict()) == {f.name for f in dataclasses.fields(RunCounts)}


def test_a_periodic_checkpoint_is_due_once_per_interval_whatever_the_iteration_sizes(tmp_path: Path) -> None:
    # The loop checks between iterations of up to 8 updates: --checkpoint-interval-updates
    # 250 must save after 250, 500, 750 ..., not only where a check lands on a multiple
    # (every 1000 updates when each iteration makes 8).
    for step in (MAX_UPDATES_PER_ITERATION, 3, 7):
        trigger = CheckpointTrigger(tmp_path, interval_steps=250)
        saves = [updates for updates in range(0, 2001, step) if trigger.periodic_due(updates)]
        assert len(saves) == (2000 // step * step) // 250, (step, saves)  # one per multiple passed
        assert all(0 <= s - 250 * (i + 1) < step for i, s in enumerate(saves)), (step, saves)
    assert not CheckpointTrigger(tmp_path).periodic_due(10_000)  # no interval: only at the end
    resumed = CheckpointTrigger(tmp_path, interval_steps=250)
    assert not resumed.periodic_due(4000)  # a resumed life counts from where it began
    assert not resumed.periodic_due(4007)
    assert resumed.periodic_due(4250)


def test_a_checkpoint_is_due_once_the_interval_in_minutes_passed() -> None:
    assert not minutes_due(10.0, saved_at=100.0, now=100.0 + 599.9)
    assert minutes_due(10.0, saved_at=100.0, now=100.0 + 600.0)
    assert minutes_due(0.5, saved_at=0.0, now=31.0)
    assert not minutes_due(0.0, saved_at=0.0, now=1e9)  # 0: off
