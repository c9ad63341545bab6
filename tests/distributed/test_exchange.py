"""Window records: the storage writes sampled windows straight into packed records, and
what the records hold equals the plain gather, field by field (no process group needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import testing
from shardreplay.kernels.codes import SHARD_SHIFT
from shardreplay.spec.keys import with_shard
from shardreplay.spec.layout import DATA, window_layout

# Big fields (own arrays), small ones (inside the per-slot record), odd sizes and offsets.
SPEC = sr.Spec({"obs": sr.Field((64,), np.float32), "pix": sr.Field((3, 5), np.uint8),
                "half": sr.Field((20,), np.float16), "action": sr.Field((), np.int64),
                "reward": sr.Field((), np.float32), "flag": sr.Field((), np.bool_)})


def _filled(window: int, storage: str, tmp_path: Path) -> sr.ReplayBuffer:
    buf = sr.ReplayBuffer(SPEC, num_streams=4, stream_capacity=50, window=window, seed=3,
                          storage=storage, directory=tmp_path if storage == "memmap" else None)
    rng = np.random.default_rng(7)
    for t in range(130):  # wraps every ring twice; episodes end at random
        types = np.where(rng.random(4) < 0.15, 2, 1) if t else np.zeros(4, np.int64)
        buf.add({"obs": rng.standard_normal((4, 64), dtype=np.float32),
                 "pix": rng.integers(0, 255, (4, 3, 5), dtype=np.uint8),
                 "half": rng.standard_normal((4, 20)).astype(np.float16),
                 "action": rng.integers(0, 9, 4), "reward": rng.standard_normal(4, dtype=np.float32),
                 "flag": rng.random(4) < 0.5, "step_type": types,
                 "discount": np.where(types == 2, 0.0, 0.99)})
    return buf


@pytest.mark.parametrize("storage", ["memory", "memmap"])
@pytest.mark.parametrize("window", [1, 2, 5])
def test_windows_written_into_records_equal_the_plain_gather(storage: str, window: int,
                                                             tmp_path: Path) -> None:
    buf = _filled(window, storage, tmp_path)
    starts = testing.shard(buf).draw(300, advance_schedule=False).starts
    data, mask, keys = testing.shard(buf).gather(starts)
    layout = window_layout(SPEC, window)
    out = np.zeros((400, layout.record_bytes), np.uint8)
    rows = np.random.default_rng(0).permutation(400)[:300]  # scattered, not in order
    got_mask, got_keys = testing.shard(buf).gather(starts, into=(out, layout.offsets(DATA), rows))
    np.testing.assert_array_equal(got_mask, mask)
    np.testing.assert_array_equal(got_keys, keys)
    views = layout.views(out)
    for name, want in data.items():
        np.testing.assert_array_equal(views[f"data.{name}"][rows], want, err_msg=name)
    untouched = np.setdiff1d(np.arange(400), rows)
    assert not out[untouched].any()  # only the named rows were written


def test_record_views_are_views_not_copies() -> None:
    layout = window_layout(SPEC, 3)
    out = np.zeros((4, layout.record_bytes), np.uint8)
    layout.views(out)["key"][2] = 123456789
    assert layout.views(out)["key"][2] == 123456789
    assert out.any()


def test_windows_into_refuses_rows_or_offsets_outside_the_records(tmp_path: Path) -> None:
    buf = _filled(2, "memory", tmp_path)
    layout = window_layout(SPEC, 2)
    starts = testing.shard(buf).draw(4, advance_schedule=False).starts
    out = np.zeros((4, layout.record_bytes), np.uint8)
    with pytest.raises(ValueError, match="rows"):
        testing.shard(buf).gather(starts, into=(out, layout.offsets(DATA), np.array([0, 1, 2, 4])))
    with pytest.raises(ValueError, match="offsets"):
        testing.shard(buf).gather(starts, into=(out, {"obs": layout.record_bytes - 8}, np.arange(4)))
    with pytest.raises(ValueError, match="C-contiguous"):
        testing.shard(buf).gather(starts, into=(out[:, :-8], layout.offsets(DATA), np.arange(4)))
    assert not out.any()


def _reference_counts(masses: np.ndarray, batches: np.ndarray, u: np.ndarray, widen: float) -> np.ndarray:
    """kernels/exchange.counts by its definition: uniform ``x`` counts for owners ``a .. c``,
    the owners of ``(x - widen) * total`` and ``(x + widen) * total`` in the masses' CDF."""
    cum = np.cumsum(masses)
    edges = cum[:np.flatnonzero(masses > 0)[-1]]
    out = np.zeros((*u.shape[:2], masses.size), np.int64)
    for r, b, j in np.ndindex(*u.shape):
        if j < batches[r]:
            ends = [(u[r, b, j] - widen) * cum[-1], (u[r, b, j] + widen) * cum[-1]]
            low, high = np.searchsorted(edges, ends, side="right")
            out[r, b, low:high + 1] += 1
    return out


def test_counts_kernel_equals_its_reference() -> None:
    from shardreplay.kernels import exchange as kernels

    rng = np.random.default_rng(11)
    for trial in range(400):
        world, k = int(rng.integers(1, 9)), int(rng.integers(1, 4))
        batches = rng.integers(1, 9, world)
        masses = rng.exponential(1, world) * (rng.random(world) < 0.7)  # some shards empty
        masses[rng.integers(world)] += 0.5
        u = rng.random((world, k, int(batches.max())))
        if trial % 3 == 0:
            u[..., 0] = np.nextafter(1.0, 0)  # u * total rounds up to the total
        widen = float(rng.choice([0.0, 1e-3, 0.05, 0.3]))
        got = kernels.counts(masses, batches, u, widen)
        np.testing.assert_array_equal(got, _reference_counts(masses, batches, u, widen), err_msg=str(trial))
        if not widen:
            np.testing.assert_array_equal(got.sum(axis=2), np.broadcast_to(batches[:, None], (world, k)))


def test_plan_and_settle_kernels_equal_the_numpy_they_replace() -> None:
    from shardreplay.kernels import exchange as kernels

    rng = np.random.default_rng(12)
    for trial in range(200):
        world, k, head = int(rng.integers(1, 9)), int(rng.integers(1, 4)), int(rng.integers(0, 3))
        batches = rng.integers(1, 9, world)
        masses = rng.exponential(1, world) * (rng.random(world) < 0.7)
        masses[rng.integers(world)] += 0.5
        u, widen = rng.random((world, k, int(batches.max()))), float(rng.choice([0.0, 1e-3, 0.05]))
        me = int(rng.integers(world))
        planned = kernels.counts(masses, batches, u, widen)
        sections = planned.sum(axis=1)  # [requester, owner]
        sent = sections[:, me]
        firsts = np.cumsum(sent + head) - sent
        want = (planned, sections.sum(axis=0), sent, firsts, planned[:me].sum(axis=(0, 1)), sections[me],
                np.concatenate([np.arange(f, f + c) for f, c in zip(firsts, sent, strict=True)]))
        planned_got, sizes, rows = kernels.plan(masses, batches, u, widen, me, head)
        for got, ref in zip((planned_got, *sizes, rows), want, strict=True):
            np.testing.assert_array_equal(got, ref, err_msg=str(trial))
        new = rng.exponential(1, world) + 0.1
        # settle: the final counts of the owners' new masses, and whether a batch is short
        posts = np.stack([np.ones(world), masses if trial % 4 == 0 else new, rng.random(world),
                          rng.random(world)], axis=1)
        again = trial % 5 == 0
        spare = bool(trial % 2) and not again  # (a redraw is drawn with no spares)
        planned = kernels.counts(masses, batches, u, widen if spare else 0.0)
        code, final, widened, low, top = kernels.settle(posts, masses, planned, batches, u, 0.5, spare, again)
        same = again or (not spare and trial % 4 == 0)
        want_final = planned if same else kernels.counts(posts[:, 1].copy(), batches, u, 0.0)
        np.testing.assert_array_equal(final, want_final)
        assert code == (kernels.REDO if (want_final > planned).any() else kernels.DONE)
        edges = [np.cumsum(m) / np.sum(m) for m in (masses, posts[:, 1])]
        moved = np.abs(edges[1] - edges[0]).max()
        assert widened == (pytest.approx(max(2 * moved, 1e-4), abs=1e-15) if spare and not again else 0.5)
        assert (low, top) == (posts[:, 2].min(), posts[:, 3].max())
        posts[rng.integers(world), 0] = 0
        assert kernels.settle(posts, masses, planned, batches, u, 0.5, spare, again)[0] == kernels.FALLBACK


def test_record_columns_written_by_the_kernel_equal_the_views() -> None:
    from shardreplay.kernels import exchange as kernels

    layout = window_layout(SPEC, 3)
    rng = np.random.default_rng(5)
    rows = rng.permutation(20)[:12]
    mask, keys = rng.random((12, 3)) < 0.5, rng.integers(0, 1 << 40, 12)
    probs = rng.random(12)
    out = np.zeros((20, layout.record_bytes), np.uint8)
    at = layout.offsets()
    kernels.write_columns(out, rows, mask.view(np.uint8), keys, 3, probs, 2.5,
                          np.array([at["mask"], at["key"], at["probability"]]))
    want = np.zeros_like(out)
    views = layout.views(want)
    views["mask"][rows], views["key"][rows] = mask, with_shard(keys, 3)
    views["probability"][rows] = probs * 2.5
    np.testing.assert_array_equal(out, want)


def test_routed_updates_packed_and_unpacked_by_the_kernels_arrive_in_order() -> None:
    from shardreplay.kernels import exchange as kernels

    rng = np.random.default_rng(8)
    for _trial in range(200):
        world, slot = int(rng.integers(1, 6)), int(rng.integers(0, 5))
        sent = [(rng.integers(0, world, m), rng.integers(0, 1 << 40, m), rng.random(m).astype(np.float32))
                for m in rng.integers(0, 9, world)]  # per sender: owners, keys of shard 0, priorities
        head = rng.integers(0, 100, 3)
        packed = [kernels.pack_updates(keys | (owners << SHARD_SHIFT), prios, head, world, slot)
                  for owners, keys, prios in sent]
        for (owners, _, _), (block, _, counts) in zip(sent, packed, strict=True):
            assert (block[:, :3] == head).all()
            np.testing.assert_array_equal(counts, np.bincount(owners, minlength=world))
            assert (block[:, 3:3 + world] == counts).all()
        for me in range(world):
            got = np.stack([block[me] for block, _, _ in packed])
            extra = np.concatenate([payload[(counts.cumsum() - counts)[me] + slot:counts.cumsum()[me]]
                                    for _, payload, counts in packed]).reshape(-1, 2)
            keys, prios = kernels.unpack_updates(got, 3, me, slot, extra)
            np.testing.assert_array_equal(keys, np.concatenate([k[o == me] for o, k, _ in sent]))
            np.testing.assert_array_equal(prios, np.concatenate([p[o == me] for o, _, p in sent]))



def test_uniforms_kernel_is_default_rng_bit_for_bit() -> None:
    from shardreplay.kernels import exchange as kernels

    rng = np.random.default_rng(3)
    seeds = [0, 1, 2**32 - 1, 2**32, 2**63 - 1, *rng.integers(0, 1 << 63, 500).tolist(),
             *rng.integers(0, 1 << 32, 100).tolist()]
    for seed in seeds:
        shape = (int(rng.integers(1, 9)), int(rng.integers(1, 4)), int(rng.integers(1, 70)))
        want = np.random.default_rng(seed).random(shape)
        np.testing.assert_array_equal(kernels.uniforms(seed, shape), want, err_msg=str(seed))
