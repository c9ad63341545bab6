"""storage="memmap" behaves exactly as storage="memory"."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardreplay import EmptyBufferError, testing
from tests.support.buffers import assert_same
from tests.support.programs import apply_write, make_buffer, random_program


@pytest.mark.parametrize("sampler", ["uniform", "prioritized", "fifo"])
def test_memmap_samples_like_memory(tmp_path: Path, sampler: str) -> None:
    prog = random_program(np.random.default_rng(21), num_streams=3, capacity=7, window=3,
                          n_writes=40, with_priorities=True)
    mem = make_buffer(prog, sampler=sampler, seed=5)
    mm = make_buffer(prog, sampler=sampler, seed=5, storage="memmap", directory=tmp_path / "arrays")
    assert isinstance(testing.shard(mm).fields["obs"], np.memmap)
    # Small fields share the per-slot record file with the bookkeeping; large ones get a file each.
    assert (tmp_path / "arrays" / "records.bin").is_file()
    mm.load_state_dict(mem.state_dict())  # takes mem's key tag, so their keys compare equal
    rng = np.random.default_rng(0)
    drawn = 0
    for op in prog.writes:
        apply_write(mem, None, op)
        apply_write(mm, None, op)
        assert len(mem) == len(mm)
        try:
            a = mem.sample(6)
        except EmptyBufferError:
            with pytest.raises(EmptyBufferError):
                mm.sample(6)
            continue
        b = mm.sample(6)
        drawn += len(a)
        assert a.keys.tolist() == b.keys.tolist()
        assert a.weights.tolist() == b.weights.tolist()
        assert a.probabilities.tolist() == b.probabilities.tolist()
        assert a.mask.tolist() == b.mask.tolist()
        for name in a.data:
            assert a.data[name].tolist() == b.data[name].tolist(), name
        if sampler == "prioritized":
            prios = rng.uniform(0, 3, len(a))
            assert mem.update_priorities(a.keys, prios) == mm.update_priorities(b.keys, prios)
    assert drawn > 50
    assert_same(mem.state_dict(), mm.state_dict())
