"""A fresh process imports ``ReplayBuffer`` and makes its first writes without numba
(kernels/lazy.py, kernels/reference/), and writes that cross from the numpy twins to
the compiled kernels leave exactly the state that compiled writes alone leave."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROGRAM = """
import json, sys
import numpy as np
import shardreplay
from shardreplay import ReplayBuffer
from shardreplay.kernels import reference

seen = {"import": "numba" in sys.modules}
spec = shardreplay.Spec({"obs": shardreplay.Field((3,), np.float32), "act": shardreplay.Field((), np.int64)})
rng = np.random.default_rng(7)

def feed(buf, n_writes):
    for i in range(n_writes):
        t = 1 + i % 3
        kinds = rng.choice([0, 1, 1, 2], (2, t)).astype(np.uint8)
        chunk = {"obs": rng.standard_normal((2, t, 3)).astype(np.float32),
                 "act": rng.integers(0, 9, (2, t)), "step_type": kinds,
                 "discount": rng.choice([0.0, 0.9, 1.0], (2, t)).astype(np.float32)}
        if i % 2:
            buf.add({k: v[:, 0] for k, v in chunk.items()}, stream_ids=np.array([1, 0]))
        else:
            buf.extend(chunk, stream_ids=np.array([2, 0]))
        if i == 2:
            seen.setdefault("first_writes", "numba" in sys.modules)

def state(buf):
    sd = buf.state_dict()
    out = {k: v.numpy().tolist() for k, v in sd["arrays"].items()}
    out["next_episode_id"] = sd["meta"]["next_episode_id"]
    out["valid"] = buf._shard._storage.valid.tolist()
    out["num_valid"] = buf._shard._storage.num_valid
    return out

kw = dict(num_streams=3, stream_capacity=7, window=3)  # the uniform sampler: no kernel on writes
a = ReplayBuffer(spec, **kw)
feed(a, reference.NUMPY_WRITES + 20)  # numpy twins, then the compiled kernels
seen["after_budget"] = "numba" in sys.modules
rng = np.random.default_rng(7)
b = ReplayBuffer(spec, **kw)
feed(b, reference.NUMPY_WRITES + 20)  # compiled throughout
seen["same_state"] = state(a) == state(b)
seen["compared"] = len(state(a))
print(json.dumps(seen))
"""


@pytest.mark.slow  # ~15 s on a loaded 2-core machine: numba loads its cache in the child
def test_first_writes_need_no_numba_and_match_compiled_writes() -> None:
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["import"] is False, "`from shardreplay import ReplayBuffer` imported numba"
    assert seen["first_writes"] is False, "the first writes of a process loaded numba"
    assert seen["after_budget"] is True, "the compiled kernels never took over"
    assert seen["compared"] > 8 and seen["same_state"] is True
