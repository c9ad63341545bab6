"""runtime/launch/learner_preload: what the learners' fork server imports, it imports with
the cyclic garbage collector paused, and leaves it running, with the imported objects frozen."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # a fresh interpreter that imports torch

PROBE = """
import gc, importlib.util, json, sys
import shardreplay.runtime.launch  # its parents (numpy, ...): imported before the preload runs
import shardreplay.runtime.forkserver  # the pause itself (multiprocessing: the fork server has it)
name = "shardreplay.runtime.launch.learner_preload"
spec = importlib.util.find_spec(name)
code = spec.loader.get_code(name)  # compiled here, when it has no bytecode yet: not counted
collections = []
gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "start" else None)
preload = sys.modules[name] = importlib.util.module_from_spec(spec)
exec(code, preload.__dict__)
missing = [m for m in preload.MODULES if m not in sys.modules]
print(json.dumps({"collections": len(collections), "enabled": gc.isenabled(),
                  "frozen": gc.get_freeze_count(), "missing": missing}))
"""


def test_the_preload_imports_without_collecting_then_freezes_and_collects_again() -> None:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(PROBE)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    # Without the pause, importing torch and torch._dynamo starts about 700 collections.
    assert out["collections"] == 0, out
    assert out["enabled"] is True and out["missing"] == []
    assert out["frozen"] > 100_000, out  # torch alone leaves several hundred thousand objects
