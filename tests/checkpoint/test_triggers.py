"""CheckpointTrigger in one process: periodic steps, requests, stop, crashes, real signals."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from shardreplay import checkpoint
from shardreplay.checkpoint import CheckpointTrigger
from shardreplay.errors import ConfigError
from tests.checkpoint.helpers import fill_random, make_buffer


def _decisions(trigger: CheckpointTrigger, steps: range) -> list[int]:
    return [s for s in steps if trigger.should_save(s)]


def test_periodic_steps_skip_the_start_step(tmp_path: Path) -> None:
    assert _decisions(CheckpointTrigger(tmp_path, interval_steps=5), range(0, 13)) == [5, 10]
    resumed = CheckpointTrigger(tmp_path, interval_steps=5)  # resumed at a saved step
    assert _decisions(resumed, range(10, 21)) == [15, 20]
    assert _decisions(CheckpointTrigger(tmp_path), range(0, 30)) == []


def test_complete_checkpoints_are_not_saved_again(tmp_path: Path) -> None:
    buf = make_buffer(2, 8)
    fill_random(buf, 4)
    checkpoint.save(buf, tmp_path, 5)
    assert _decisions(CheckpointTrigger(tmp_path, interval_steps=5), range(0, 11)) == [10]


def test_request_flag_and_request_file_each_save_once(tmp_path: Path) -> None:
    trigger = CheckpointTrigger(tmp_path)
    assert not trigger.should_save(1)
    trigger.request_save()
    assert trigger.should_save(2) and trigger.reason == "request"
    assert not trigger.should_save(3)
    trigger.request_file.touch()
    assert trigger.should_save(4) and trigger.reason == "request"
    assert not trigger.request_file.exists()
    assert not trigger.should_save(5)


def test_stop_saves_once_and_stops(tmp_path: Path) -> None:
    trigger = CheckpointTrigger(tmp_path, interval_steps=100)
    saved: list[int] = []
    assert not trigger.maybe_save(1, saved.append)
    trigger.request_stop()
    assert trigger.maybe_save(2, saved.append) and trigger.reason == "stop"
    assert not trigger.should_save(3) and trigger.stop_requested
    assert saved == [2]


def test_a_stop_landing_after_the_decision_is_saved_before_stopping(tmp_path: Path) -> None:
    """SIGTERM between should_save's check and maybe_save's answer (seen once in CI on
    three gloo ranks): the loop must not be told to stop before the part is saved."""
    trigger = CheckpointTrigger(tmp_path, interval_steps=100)
    saved: list[int] = []
    agree = trigger._agree_request

    def signal_during_agreement(step: int) -> bool:
        trigger.request_stop()  # what the handler does if the signal lands here
        return agree(step)

    trigger._agree_request = signal_during_agreement  # type: ignore[method-assign]
    assert not trigger.maybe_save(1, saved.append) and saved == []
    assert trigger.maybe_save(2, saved.append) and saved == [2] and trigger.reason == "stop"


def test_real_signals(tmp_path: Path) -> None:
    trigger = CheckpointTrigger(tmp_path)
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    trigger.install_signal_handlers()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert trigger.should_save(1) and trigger.reason == "request"
        os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C stops gracefully
        assert trigger.should_save(2) and trigger.reason == "stop" and trigger.stop_requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the second one interrupts
        other = CheckpointTrigger(tmp_path)
        other.install_signal_handlers()
        os.kill(os.getpid(), signal.SIGTERM)
        assert other.should_save(7) and other.reason == "stop"
        other.restore_signal_handlers()
    finally:
        trigger.restore_signal_handlers()
    assert {s: signal.getsignal(s) for s in before} == before


def test_save_on_exception(tmp_path: Path) -> None:
    trigger = CheckpointTrigger(tmp_path)
    saved: list[int] = []
    with pytest.raises(RuntimeError, match="boom"), trigger.save_on_exception(saved.append):
        trigger.should_save(3)
        raise RuntimeError("boom")
    assert saved == [3]
    with pytest.raises(SystemExit), trigger.save_on_exception(saved.append):
        raise SystemExit(0)
    with pytest.raises(KeyboardInterrupt), trigger.save_on_exception(saved.append):
        trigger.should_save(4)
        raise KeyboardInterrupt
    assert saved == [3, 4]

    def failing(step: int) -> None:
        raise OSError("disk full")

    with pytest.raises(ValueError, match="original"), trigger.save_on_exception(failing):
        raise ValueError("original")  # the save's own failure is logged, not raised


def test_bad_settings() -> None:
    with pytest.raises(ConfigError):
        CheckpointTrigger("x", interval_steps=0)
    with pytest.raises(ConfigError):
        CheckpointTrigger("x", collectives=object())


def test_periodic_saves_once_per_interval_passed_when_steps_jump(tmp_path: Path) -> None:
    # A learner asks between iterations of several updates: interval 250 must save after
    # 250, 500, ..., not only where a call lands on a multiple (every 1000 at 8 a call).
    for jump in (8, 3, 7):
        trigger = CheckpointTrigger(tmp_path, interval_steps=250)
        saves = [s for s in range(0, 2001, jump) if trigger.periodic_due(s)]
        assert len(saves) == (2000 // jump * jump) // 250, (jump, saves)
        assert all(0 <= s - 250 * (i + 1) < jump for i, s in enumerate(saves)), (jump, saves)
    resumed = CheckpointTrigger(tmp_path, interval_steps=250)  # counts from where it starts
    assert not resumed.periodic_due(4000) and not resumed.periodic_due(4007)
    assert resumed.periodic_due(4250)


def test_a_request_agreed_elsewhere_is_served_once(tmp_path: Path) -> None:
    """The learner agrees on requests in its own per-iteration sync: it reads
    request_pending and calls request_served; the request file may live elsewhere."""
    trigger = CheckpointTrigger(tmp_path / "checkpoints", request_dir=tmp_path)
    assert trigger.request_file == tmp_path / "checkpoint.request"
    assert not trigger.request_pending()
    trigger.request_file.touch()
    assert trigger.request_pending()
    trigger.request_served(remove_file=False)  # a rank that leaves the file to rank 0
    assert trigger.request_pending() and trigger.request_file.exists()
    trigger.request_served()
    assert not trigger.request_pending()
    trigger.request_save()
    assert trigger.request_pending()
    trigger.request_served()
    assert not trigger.request_pending()


def test_a_repeated_interrupt_can_be_made_to_only_stop(tmp_path: Path) -> None:
    trigger = CheckpointTrigger(tmp_path)
    before = signal.getsignal(signal.SIGINT)
    trigger.install_signal_handlers(repeat_interrupt=False)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: the loop saves and stops
        assert trigger.should_save(1) and trigger.reason == "stop"
    finally:
        trigger.restore_signal_handlers()
    assert signal.getsignal(signal.SIGINT) == before
