"""A fresh process imports ``ReplayBuffer`` and checks steps without numba (kernels/lazy.py,
kernels/reference/: an actor that only checks the chunks it sends never loads it); its first
write runs the compiled kernels (docs/internals.md, "Numpy twins and lazy kernels")."""

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

seen = {"import": "numba" in sys.modules}
spec = shardreplay.Spec({"obs": shardreplay.Field((3,), np.float32), "act": shardreplay.Field((), np.int64)})
buf = ReplayBuffer(spec, num_streams=3, stream_capacity=7, window=3)
step = {"obs": np.ones((3, 3), np.float32), "act": np.arange(3), "step_type": np.zeros(3, np.uint8)}
spec.validate(step, (3,))
refused = []
bads = ({"obs": np.full((3, 3), np.nan, np.float32)},
        {"step_type": np.full(3, 5)}, {"discount": np.full(3, 2.0)})
for bad in bads:
    try:
        spec.validate({**step, **bad}, (3,))
    except shardreplay.SpecMismatchError as e:
        refused.append(str(e))
seen["checks"] = "numba" in sys.modules
seen["refused"] = refused
buf.add(step)
seen["write"] = "numba" in sys.modules
seen["stored"] = buf.num_steps
print(json.dumps(seen))
"""


@pytest.mark.slow  # ~10 s on a loaded 2-core machine: numba loads its cache in the child
def test_imports_and_checks_need_no_numba_and_writes_run_compiled() -> None:
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["import"] is False, "`from shardreplay import ReplayBuffer` imported numba"
    assert seen["checks"] is False, "checking steps loaded numba"
    assert len(seen["refused"]) == 3 and "NaN" in seen["refused"][0], seen["refused"]
    assert seen["write"] is True and seen["stored"] == 3
