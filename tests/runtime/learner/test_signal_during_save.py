"""A stop signal during a background checkpoint finishes it (issue 22, item 1).

A child process installs the learner's signal handlers (``learner_trigger``), starts a
background save and trains on (writes that overwrite the oldest rows). The save's forked
writer is held mid-write by a hook until the learner has taken the stop signal (it then
creates a file the writer waits for), so the signal always lands during the write (no
sleep race). The child then stops as the learner does: its
``LearnerCheckpoints.finish`` waits for the save in flight, then it makes the final save and
exits 0. Checked here: exit status 0, the checkpoint taken before the signal complete,
hash-verified and restoring the buffer as at its call, the final one complete too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import checkpoint

_CHILD = r"""
import os, sys, time, types
from pathlib import Path
import numpy as np
import shardreplay as sr
from shardreplay import checkpoint
import shardreplay.checkpoint.saving as save_impl
from shardreplay.runtime.learner.checkpoints import LearnerCheckpoints
from shardreplay.runtime.learner.state import StorageGuard
from shardreplay.runtime.learner.sync import learner_trigger
from shardreplay.runtime.settings import TrainSettings

run_dir = Path(sys.argv[1])
trigger = learner_trigger(TrainSettings(), run_dir)  # SIGTERM/SIGINT: ask to stop, as a learner rank
spec = sr.Spec({"obs": sr.Field((16,), np.float32)})
buf = sr.ReplayBuffer(spec, num_streams=2, stream_capacity=100, window=1, sampler="uniform", seed=0)

def chunk(t):
    v = t + np.arange(2 * 20, dtype=np.float32).reshape(2, 20)
    return {"obs": np.repeat(v[..., None], 16, -1), "step_type": np.ones((2, 20), np.uint8)}

for t in range(8):
    buf.extend(chunk(1000 * t))
np.savez(run_dir / "at_call.npz", **{k: v.numpy() for k, v in buf.state_dict()["arrays"].items()})

real_write_part = save_impl._write_part
go = run_dir / "go"
def held_write_part(*args):  # the writer is mid-write: hold it until the learner took the signal
    os.write(1, b"writing\n")
    while not go.exists():
        time.sleep(0.01)
    return real_write_part(*args)
save_impl._write_part = held_write_part

root = run_dir / "checkpoints"
# No collective is made by a save: the learners' collectives are not needed here.
ckpts = LearnerCheckpoints(run_dir, 0, 1, types.SimpleNamespace(), StorageGuard(0), keep_last=3)
ckpts.pending = checkpoint.save_in_background(buf, root, 1)
t = 100
while not trigger.stop_requested:  # the learner trains on meanwhile
    buf.extend(chunk(1000 * t))
    t += 1
go.touch()
save_impl._write_part = real_write_part
ckpts.finish(wait=True)  # what a save does first on a stop
assert ckpts.pending is None and ckpts.complete == 1, ckpts.__dict__
checkpoint.save(buf, root, 2)
print("stopped", flush=True)
"""


@pytest.mark.slow  # one child interpreter importing the learner (torch): ~5 CPU-s, ~20 s on busy cores
def test_sigterm_during_a_background_save_finishes_it_and_exits_cleanly(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "writing"
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
        child.wait(30)
    assert child.returncode == 0 and out.strip() == "stopped", err
    root = tmp_path / "checkpoints"
    assert checkpoint.is_complete(checkpoint.checkpoint_dir(root, 1), hashes=True)
    assert checkpoint.latest_complete(root) == 2
    buf = sr.ReplayBuffer(sr.Spec({"obs": sr.Field((16,), np.float32)}), num_streams=2, stream_capacity=100,
                          window=1, sampler="uniform")
    assert checkpoint.load(root, buf, checkpoint_id=1).exact
    with np.load(tmp_path / "at_call.npz", allow_pickle=False) as at_call:
        arrays = buf.state_dict()["arrays"]
        assert set(at_call.files) == set(arrays)
        for name in at_call.files:
            np.testing.assert_array_equal(arrays[name].numpy(), at_call[name], err_msg=name)
