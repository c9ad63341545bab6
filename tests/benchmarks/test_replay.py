"""The replay benchmark's own logic: step types from done flags, ratios, a smoke run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.env import BENCHMARKS

BENCH_DIR = BENCHMARKS / "replay"

import bench_replay  # noqa: E402
import replay_workload as W  # noqa: E402


def test_step_types_follow_done_flags() -> None:
    # Calls in rows, two streams in columns.
    done = np.array([[0, 0], [1, 0], [0, 1], [1, 1], [0, 0], [1, 0]], dtype=bool)
    got = W.step_types(done, first_call=True)
    f, m, last = W.FIRST, W.MID, W.LAST
    # stream 0: FIRST, LAST (done), FIRST, LAST, FIRST, LAST
    # stream 1: FIRST, MID, LAST, FIRST (its done is ignored: a reset cannot end), MID, MID
    assert got[:, 0].tolist() == [f, last, f, last, f, last]
    assert got[:, 1].tolist() == [f, m, last, f, m, m]
    # A later pass follows the last call: stream 0 ended with LAST, so it starts FIRST.
    again = W.step_types(done, first_call=False)
    assert again[:, 0].tolist() == [f, last, f, last, f, last]
    assert again[:, 1].tolist() == [m, m, last, f, m, m]


def test_step_types_of_the_pool_are_valid_episodes() -> None:
    done = np.stack([b["done"] for b in W.split_batches(W.make_pool(seed=0))])
    first = W.step_types(done, first_call=True)
    later = W.step_types(done, first_call=False)
    assert (first[0] == W.FIRST).all()
    # A step is FIRST exactly after a LAST; a later pass follows the previous pass's end.
    assert np.array_equal(first[1:] == W.FIRST, first[:-1] == W.LAST)
    assert np.array_equal(later[1:] == W.FIRST, later[:-1] == W.LAST)
    assert np.array_equal(later[0] == W.FIRST, first[-1] == W.LAST)
    assert np.array_equal(later[-1], first[-1])  # so every pass after the first is the same
    assert 0.005 < (first == W.LAST).mean() < 0.015


def test_ratios_and_targets_with_a_missing_peer() -> None:
    results = {
        "shardreplay": {
            "uniform": {"sample_batches_per_s": 300.0, "insert_tps": 50.0, "rss_mib_buffer": 30.0},
            "prioritized": {"learner_steps_per_s": 90.0, "insert_tps": 200.0, "rss_mib_buffer": 40.0},
        },
        "cpprb": {
            "uniform": {"sample_batches_per_s": 100.0, "insert_tps": 100.0, "rss_mib_buffer": 100.0},
            "prioritized": {"learner_steps_per_s": 30.0, "insert_tps": 100.0, "rss_mib_buffer": 100.0},
        },
        "torchrl": {"uniform": {"missing": "torchrl: no module"}, "prioritized": {"missing": "x"}},
    }
    values, targets = bench_replay.ratios(results)
    assert values["prioritized_learner_step_vs_cpprb"] == 3.0
    assert values["prioritized_learner_step_vs_torchrl"] is None
    assert targets["prioritized_learner_step_vs_torchrl"]["met"] is None
    assert values["uniform_sample_vs_cpprb"] == 3.0
    assert values["insert_vs_cpprb"] == 0.5  # the worse of the two modes
    assert targets["insert_vs_cpprb"] == {"target": ">= 1.0", "met": False}
    assert values["rss_vs_cpprb"] == 0.4  # the worse (larger) of the two modes
    assert targets["rss_vs_cpprb"]["met"] is True


@pytest.mark.slow
def test_quick_run_prints_one_json_line(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH_DIR / "bench_replay.py"), "--quick", "--libs", "shardreplay",
         "--n-insert", "3200", "--calls", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    line = json.loads(lines[0])
    assert json.loads(out.read_text()) == line
    prio = line["results"]["shardreplay"]["prioritized"]
    assert prio["stored"] == 3200
    assert 0 < prio["valid_windows"] < 3200
    for key in ("insert_tps", "sample_batches_per_s", "update_calls_per_s", "learner_steps_per_s"):
        assert prio[key] > 0, key
    assert line["results"]["shardreplay"]["uniform"]["sample_batches_per_s"] > 0
    assert line["ratios"]["uniform_sample_vs_cpprb"] is None  # cpprb not selected
    one_env = line["results"]["shardreplay"]["single_env"]
    assert one_env["capacity"] == 3200 and one_env["add_calls_per_s"] > 0 and one_env["sample_us"] > 0
    assert line["ratios"]["single_env_add_vs_sb3"] is None  # sb3 not selected


def test_single_env_ratios_are_against_sb3() -> None:
    results = {"shardreplay": {"single_env": {"add_calls_per_s": 300.0, "sample_calls_per_s": 50.0}},
               "sb3": {"single_env": {"add_calls_per_s": 200.0, "sample_calls_per_s": 100.0}}}
    values, targets = bench_replay.ratios(results)
    assert values["single_env_add_vs_sb3"] == 1.5 and targets["single_env_add_vs_sb3"]["met"] is True
    assert values["single_env_sample_vs_sb3"] == 0.5 and targets["single_env_sample_vs_sb3"]["met"] is False


def test_merge_runs_takes_medians_and_widest_ranges() -> None:
    runs = [
        {"version": "1", "sample_batches_per_s": 10.0, "sample_batches_per_s_range": [8.0, 12.0]},
        {"version": "1", "sample_batches_per_s": 30.0, "sample_batches_per_s_range": [5.0, 40.0]},
        {"version": "1", "sample_batches_per_s": 20.0, "sample_batches_per_s_range": [15.0, 25.0]},
    ]
    merged = bench_replay.merge_runs(runs)
    assert merged["sample_batches_per_s"] == 20.0
    assert merged["sample_batches_per_s_runs"] == [10.0, 30.0, 20.0]
    assert merged["sample_batches_per_s_range"] == [5.0, 40.0]
    assert merged["version"] == "1" and merged["repeats"] == 3
    ratios = bench_replay.merge_runs([{"sample_batches_per_s_vs_cpprb": v} for v in (1.162, 1.205, 1.147)])
    assert ratios["sample_batches_per_s_vs_cpprb"] == 1.162  # paired ratios keep 3 places
    assert bench_replay.merge_runs([runs[0], {"error": "child exited"}]) == {"error": "child exited"}


def test_best_block_ratios_use_the_fastest_block_and_chunk() -> None:
    results = {
        "shardreplay": {"uniform": {"sample_batches_per_s": 10.0, "sample_batches_per_s_range": [5.0, 40.0],
                                    "insert_tps": 1.0, "insert_tps_best_chunk": 8.0}},
        "cpprb": {"uniform": {"sample_batches_per_s": 10.0, "sample_batches_per_s_range": [9.0, 20.0],
                              "insert_tps": 1.0, "insert_tps_best_chunk": 4.0}},
    }
    median, _ = bench_replay.ratios(results)
    best, targets = bench_replay.ratios(results, best=True)
    assert median["uniform_sample_vs_cpprb"] == 1.0
    assert best["uniform_sample_vs_cpprb"] == 2.0
    assert best["uniform_insert_vs_cpprb"] == 2.0
    assert targets["insert_vs_cpprb"]["met"] is None  # the prioritized half is missing


def test_fill_sweep_pools_cycle_at_episode_ends_and_ratios_are_time_ratios() -> None:
    import replay_fill_sweep as S

    pool = S._kind_pool("pixel", np.random.default_rng(0))
    assert S.POOL % S.EPISODE == 0 and pool["done"][-1, 0]  # the cycle restarts at FIRST
    obs = pool["obs"][:, 0]
    assert np.array_equal(obs[1:, :3], obs[:-1, 1:])  # each stack shifts one frame in
    got = S.interleaved(lambda: sum(range(200)), lambda: None, blocks=3, calls=20)
    assert set(got) == {"shardreplay_us", "sb3_us", "ratio", "ratio_min", "ratio_max"}
    assert got["ratio"] > 1  # ours is slower here
    assert got["ratio_min"] <= got["ratio"] <= got["ratio_max"]  # the per-block range holds the median


def test_single_env_alternates_the_libraries_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    import replay_single_env as E

    calls: list[tuple[str, str, int]] = []

    def fake(name: str, cost: int) -> type:
        class Case:
            def __init__(self, seed: int) -> None:
                pass

            def versions(self) -> dict[str, str]:
                return {"version": "0"}

            def create(self, capacity: int) -> None:
                calls.clear()

            def add(self, i: int) -> None:
                calls.append((name, "add", i))
                sum(range(cost))

            def sample(self, i: int) -> None:
                calls.append((name, "sample", i))
                sum(range(cost))
        return Case

    monkeypatch.setattr(E, "CASES", {"shardreplay": fake("shardreplay", 2_000), "sb3": fake("sb3", 20)})
    monkeypatch.setattr(E, "ADD_BLOCK_CALLS", 10)
    got = E.run(["shardreplay", "sb3"], 40, calls=5, blocks=3, warmup=0, seed=0)
    adds = [(lib, i) for lib, op, i in calls if op == "add"]
    # Four rounds of ten adds, ours then SB3's, each library's inputs running on.
    assert [lib for lib, _ in adds[::10]] == ["shardreplay", "sb3"] * 4
    assert [i for lib, i in adds if lib == "sb3"] == list(range(40))
    assert [lib for lib, op, _ in calls if op == "sample"][::5] == ["shardreplay", "sb3"] * 3
    ours = got["shardreplay"]
    low, high = ours["add_calls_per_s_vs_sb3_range"]
    assert high < 1 and low <= ours["add_calls_per_s_vs_sb3"] <= high  # ours is the slower here
    assert got["sb3"]["add_calls_per_s"] > ours["add_calls_per_s"] and "sample_us" in got["sb3"]
    # The parent reports the alternated median, not the ratio of the two medians.
    results = {"shardreplay": {"single_env": {**ours, "add_calls_per_s": 1.0}},
               "sb3": {"single_env": got["sb3"]}}
    assert bench_replay.ratios(results)[0]["single_env_add_vs_sb3"] == ours["add_calls_per_s_vs_sb3"]


def test_paired_sampling_alternates_buffers_and_reports_paired_medians(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import replay_cases

    order: list[str] = []

    def fake(cost: int) -> type:
        class Case:
            buf = None

            def prepare(self, pool: dict[str, np.ndarray], seed: int) -> None:
                pass

            def create(self, mode: str, capacity: int = 0) -> None:
                self.mode = mode
                order.clear()

            def add(self, i: int) -> None:
                pass

            def sample(self) -> None:
                order.append(self.mode if cost > 100 else "cpprb")
                sum(range(cost if self.mode == "uniform" else 4 * cost))

            def sample_for_update(self) -> None:
                pass

            def update(self, keys: None, i: int) -> None:
                pass

            def learner_step(self, i: int) -> None:
                pass
        return Case

    monkeypatch.setattr(replay_cases, "CASES", {"shardreplay": fake(2_000), "cpprb": fake(20)})
    args = bench_replay.parse_args(["--quick", "--libs", "shardreplay,cpprb", "--n-insert", "64",
                                    "--blocks", "3", "--calls", "4", "--warmup", "0", "--mode", "uniform"])
    got = bench_replay.run_paired(args)
    # One block of each buffer per round, the first buffer turning each round.
    assert order[::4] == ["uniform", "prioritized", "cpprb", "prioritized", "cpprb", "uniform",
                          "cpprb", "uniform", "prioritized"]
    low, high = got["sample_batches_per_s_vs_cpprb_range"]
    assert high < 1 and low <= got["sample_batches_per_s_vs_cpprb"] <= high  # ours is the slower here
    assert got["sample_batches_per_s_vs_prioritized"] > 1  # the fake prioritized sample costs 4x
    # The parent reports the paired medians, not the ratio of the separate children's rates.
    results = {"shardreplay": {"uniform": {**got, "sample_batches_per_s": 1.0}},
               "cpprb": {"uniform": {"sample_batches_per_s": 1.0}}}
    values, targets = bench_replay.ratios(results)
    assert values["uniform_sample_vs_cpprb"] == got["sample_batches_per_s_vs_cpprb"]
    assert values["uniform_sample_vs_prioritized"] == got["sample_batches_per_s_vs_prioritized"]
    assert targets["uniform_sample_vs_prioritized"]["met"] is True


def test_paired_learner_steps_alternate_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    import replay_cases

    order: list[str] = []

    def fake(name: str, cost: int) -> type:
        class Case:
            def prepare(self, pool: dict[str, np.ndarray], seed: int) -> None:
                pass

            def create(self, mode: str, capacity: int = 0) -> None:
                assert mode == "prioritized"
                order.clear()

            def add(self, i: int) -> None:
                pass

            def sample(self) -> None:
                pass

            def sample_for_update(self) -> None:
                pass

            def update(self, keys: None, i: int) -> None:
                pass

            def learner_step(self, i: int) -> None:
                order.append(name)
                sum(range(cost))
        return Case

    monkeypatch.setattr(replay_cases, "CASES",
                        {"shardreplay": fake("ours", 500), "cpprb": fake("cpprb", 5_000)})
    args = bench_replay.parse_args(["--quick", "--libs", "shardreplay,cpprb", "--n-insert", "64", "--blocks",
                                    "4", "--calls", "3", "--warmup", "0", "--mode", "prioritized"])
    got = bench_replay.run_paired(args)
    assert order[::3] == ["ours", "cpprb", "cpprb", "ours", "ours", "cpprb", "cpprb", "ours"]
    low, high = got["learner_steps_per_s_vs_cpprb_range"]
    assert 1 < low <= got["learner_steps_per_s_vs_cpprb"] <= high  # the fake cpprb step costs 10x
    results = {"shardreplay": {"prioritized": {**got, "learner_steps_per_s": 1.0}},
               "cpprb": {"prioritized": {"learner_steps_per_s": 5.0}}}
    assert bench_replay.ratios(results)[0]["prioritized_learner_step_vs_cpprb"] == got[
        "learner_steps_per_s_vs_cpprb"]
