"""kernels/cache_lock: two processes that compile different signatures of one kernel at
the same moment both find their code in numba's cache afterwards; two that need the same
signature at the same moment compile it once.

numba reads a kernel's index, picks the first free data file, writes the index, then the
data; the children here sleep inside that window (numba's own ``_save_index``, slowed) so
that their saves overlap for certain. Without the lock both pick data file 1 and one
signature is lost from the index (or, worse, named with the other's code: the "can't unbox
array" the suite once met); with it, the saves take turns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # fresh interpreters (two or three a test) that import numba

KERNEL = """
import numba

@numba.njit(cache=True)
def double(x):
    return x * 2
"""

COMPILE = """
import os, sys, time
import numpy as np
directory, locked, dtype = sys.argv[1], sys.argv[2] != "unlocked", sys.argv[3]
sys.path.insert(0, directory)
if locked:
    import shardreplay.kernels.cache_lock as cache_lock
    if sys.argv[2] == "impatient":
        cache_lock.COMPILE_WAIT_S = 0.5
        # The holder keeps the lock 3 s before anything is saved, so the one that gives up
        # after 0.5 s finds nothing to load even when it started a few seconds later.
        from numba.core import dispatcher
        compile_now = dispatcher._FunctionCompiler.compile

        def slow_compile(self, args, return_type):
            time.sleep(3.0)
            return compile_now(self, args, return_type)

        dispatcher._FunctionCompiler.compile = slow_compile
from numba.core import caching

save_index = caching.IndexDataCacheFile._save_index

def slow_save_index(self, overloads):
    time.sleep(3.0)  # between numba's reading of the index and its writing
    save_index(self, overloads)

caching.IndexDataCacheFile._save_index = slow_save_index
while not os.path.exists(os.path.join(directory, "go")):
    time.sleep(0.01)
import kern
print(kern.double(np.arange(3, dtype=dtype)).tolist())
print(sum(kern.double.stats.cache_misses.values()))  # 1: compiled here, 0: loaded
"""

LOAD = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import shardreplay.kernels.cache_lock  # noqa: F401
import kern
out = {d: kern.double(np.arange(3, dtype=d)).tolist() for d in ("int64", "float64")}
out["misses"] = sum(kern.double.stats.cache_misses.values())
print(json.dumps(out))
"""


def _compile_concurrently(directory: Path, mode: str,
                          dtypes: tuple[str, str] = ("int64", "float64")) -> list[int]:
    """Two processes compile ``double`` for ``dtypes`` at once; returns how many
    signatures each compiled (the others it loaded from the cache)."""
    (directory / "kern.py").write_text(KERNEL)
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(COMPILE), str(directory), mode, dtype],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "NUMBA_CACHE_DIR": str(directory / "cache")})
             for dtype in dtypes]
    time.sleep(0.5)
    (directory / "go").touch()
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    return sorted(int(out.split()[-1]) for out, _err in outs)


def _data_files(directory: Path) -> int:
    """Compiled signatures numba wrote (one data file each; racing saves share one)."""
    return len(list((directory / "cache").rglob("*.nbc")))


def test_without_the_lock_overlapping_saves_lose_a_signature(tmp_path: Path) -> None:
    """The control: the scenario does hit numba's race (so the next test means something)."""
    _compile_concurrently(tmp_path, "unlocked")
    assert _data_files(tmp_path) == 1


def test_with_the_lock_both_signatures_load_with_their_own_code(tmp_path: Path) -> None:
    _compile_concurrently(tmp_path, "locked")
    assert _data_files(tmp_path) == 2
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(LOAD), str(tmp_path)], capture_output=True,
                          text=True, timeout=180, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out == {"int64": [0, 2, 4], "float64": [0.0, 2.0, 4.0], "misses": 0}


@pytest.mark.parametrize("mode", ["unlocked", "locked", "impatient"])
def test_one_signature_needed_by_two_processes_at_once_is_compiled_once_with_the_lock(
        tmp_path: Path, mode: str) -> None:
    """The first to take the signature's lock compiles and saves it (its save slowed to
    3 s, so the other asks meanwhile); the other waits, then loads it. Unlocked (the
    control) both compile; so do two that wait at most 0.5 s for the lock (a holder that
    never lets go costs the others their own compile, not a hang)."""
    compiled = _compile_concurrently(tmp_path, mode, ("int64", "int64"))
    assert compiled == ([0, 1] if mode == "locked" else [1, 1])
    assert _data_files(tmp_path) == 1


def test_a_kernel_cache_entry_is_stale_when_any_kernel_module_changes(tmp_path: Path) -> None:
    """numba stamps a cache entry with its kernel's own file only; kernels inline code from
    other files here (add_step inlines kernels/storage.py), whose change then left the old
    compiled code in use. The stamp of every kernel module joins it."""
    from numba.core import caching

    import shardreplay.kernels.cache_lock as cache_lock

    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 1\n")
    before = cache_lock.modules_stamp(str(tmp_path))
    os.utime(tmp_path / "b.py", ns=(0, 10**18))
    assert cache_lock.modules_stamp(str(tmp_path)) != before
    (tmp_path / "b.py").write_text("y = 22\n")
    assert len({before, cache_lock.modules_stamp(str(tmp_path))}) == 2

    kernels = Path(cache_lock.__file__).parent
    ours = caching.InTreeCacheLocator(cache_lock.modules_stamp, str(kernels / "storage.py"))
    plain = cache_lock._STAMP(ours)
    assert ours.get_source_stamp() == (plain, cache_lock.modules_stamp(str(kernels)))
    (tmp_path / "kern.py").write_text("x = 1\n")
    other = caching.InTreeCacheLocator(cache_lock.modules_stamp, str(tmp_path / "kern.py"))
    assert other.get_source_stamp() == cache_lock._STAMP(other)  # another library's: numba's rule
