"""An actor whose learner is SIGKILLed while the actor waits for room in the learner's
local ring (nobody drains it any more) exits at once, instead of waiting out its send
timeout and then another attempt for the chunk it still holds.

The learner here is a stand-in process that starts a real :class:`ActorPool` on a real
ring with room for one chunk and never reads it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from shardreplay.runtime.actor.loop import ActorSettings
from shardreplay.runtime.actor.processes import ActorPool
from shardreplay.runtime.routing import chunk_bytes
from shardreplay.transport.local import LocalTransport
from tests.runtime.runtime_helpers import CARTPOLE_SPEC, publish_cartpole_policy

START_S = 90.0  # the actor imports torch and gymnasium: seconds on a loaded machine


def _stand_in_learner(settings: ActorSettings, out: Any) -> None:
    capacity = max(1024, chunk_bytes(CARTPOLE_SPEC, settings.envs_per_actor, settings.chunk_steps) + 64)
    transport = LocalTransport(CARTPOLE_SPEC, capacity_bytes=capacity)  # one chunk fits
    pool = ActorPool([settings], transport, max_restarts=0)
    pool.start()
    out.put(pool.pids()[0])
    reader = transport.reader()  # never receives: only to see the ring fill
    while reader._ring._meta[0] == 0:  # head: no chunk written yet
        time.sleep(0.05)
    out.put("full")
    time.sleep(600)


def _next(out: Any, learner: Any) -> Any:
    """The stand-in's next message; fails at once when it died."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            return out.get(timeout=0.5)
        assert learner.exitcode is None, f"the stand-in learner exited with {learner.exitcode}"
    raise AssertionError(f"nothing from the stand-in learner in {START_S} s")


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow  # fresh interpreters or many examples: 20-100 s at load ~9 on 2 cores
def test_actor_exits_at_once_when_its_learner_dies_while_it_waits_for_room(tmp_path: Path) -> None:
    policy = f"file://{tmp_path}/policy"
    publish_cartpole_policy(policy, 1)
    settings = ActorSettings(actor_id=0, num_actors=1, num_shards=1, envs_per_actor=2, chunk_steps=4,
                             transport="local", policy_url=policy, hidden=(16,), seed=1,
                             policy_check_interval_s=0.1, send_timeout_s=5.0)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    learner = ctx.Process(target=_stand_in_learner, args=(settings, out))
    learner.start()
    actor = None
    try:
        actor = psutil.Process(_next(out, learner))
        assert _next(out, learner) == "full"
        time.sleep(1.0)  # the actor made its next chunk and waits for room
        assert actor.status() != psutil.STATUS_ZOMBIE
        started = time.monotonic()
        learner.kill()
        learner.join(10)
        while not _gone(actor) and time.monotonic() - started < 20:
            time.sleep(0.01)
        took = time.monotonic() - started
        assert _gone(actor), "the actor outlived its learner by 20 s"
        # Well under the send timeout (5 s): the actor notices its learner is gone, it
        # does not wait for a send to time out.
        assert took < 1.5, f"the actor took {took:.2f} s to exit after its learner died"
    finally:
        learner.kill()
        learner.join(10)
        if actor is not None:
            with contextlib.suppress(psutil.Error):
                actor.kill()
        out.close()
