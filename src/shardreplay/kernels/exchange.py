"""The sharded exchange's bookkeeping: the routed priority updates' block and what arrives
(distributed/priorities.py); every requester's shard counts, the move of the counts' CDF,
the owner's write of the record columns it fills, and the requester's copy plan
(distributed/exact_exchange.py)."""

from __future__ import annotations

import numba
import numpy as np

from shardreplay.kernels import cache_lock  # noqa: F401  (numba's cache, safe across processes)
from shardreplay.kernels.codes import LOCAL_MASK, SHARD_SHIFT


@numba.njit(cache=True, nogil=True)
def counts(masses, batches, u, widen):  # pragma: no cover - compiled
    """Items per ``[requester r, batch, owner]``: uniform ``u[r, b, j]`` (``j <
    batches[r]``) goes to the owner whose share of the masses' CDF holds it; with
    ``widen``, to every owner whose share taken ``widen`` wider on both sides holds it.
    ``u * total`` rounded up to the total counts for the last owner of positive mass."""
    cum = np.cumsum(masses)
    last = 0
    for o in range(masses.shape[0]):
        if masses[o] > 0:
            last = o
    out = np.zeros((u.shape[0], u.shape[1], masses.shape[0]), np.int64)
    for r in range(u.shape[0]):
        for b in range(u.shape[1]):
            for j in range(batches[r]):
                low, high = (u[r, b, j] - widen) * cum[-1], (u[r, b, j] + widen) * cum[-1]
                first = second = 0  # the owners of the point moved down and moved up
                for e in range(last):
                    first += not low < cum[e]
                    second += not high < cum[e]
                out[r, b, first:second + 1] += 1
    return out


@numba.njit(cache=True, nogil=True)
def cdf_move(before, after):  # pragma: no cover - compiled
    """The largest move of the normalised cumulative masses from ``before`` to ``after``."""
    a, b = np.cumsum(before), np.cumsum(after)
    return np.abs(a / a[-1] - b / b[-1]).max()


@numba.njit(cache=True, nogil=True)
def write_columns(out, rows, mask, keys, shard, probs, scale, at):  # pragma: no cover - compiled
    """Write into rows ``rows`` of the uint8 records ``out`` the mask bytes ``mask``
    (``[m, L]`` uint8) at byte ``at[0]``, ``keys`` with shard field ``shard`` at ``at[1]``,
    and ``probs * scale`` (float64) at ``at[2]``."""
    word = np.empty(1, np.int64)
    real = np.empty(1, np.float64)
    word_bytes, real_bytes = word.view(np.uint8), real.view(np.uint8)
    high = np.int64(shard) << SHARD_SHIFT
    for i in range(rows.shape[0]):
        row = out[rows[i]]
        row[at[0]:at[0] + mask.shape[1]] = mask[i]
        word[0] = (keys[i] & LOCAL_MASK) | high
        row[at[1]:at[1] + 8] = word_bytes
        real[0] = probs[i] * scale
        row[at[2]:at[2] + 8] = real_bytes


@numba.njit(cache=True, nogil=True)
def take_plan(drawn, got, n):  # pragma: no cover - compiled
    """The requester's copies, ``[m, 4]`` rows ``(owner, first row in the owner's block,
    first row of the batches, count)``: batch ``b`` takes the first ``got[b, o]`` of the
    ``drawn[b, o]`` rows owner ``o`` drew for it, owners in order, from row ``b * n``."""
    plan = np.empty((got.size, 4), np.int64)
    src = np.zeros(got.shape[1], np.int64)
    m = 0
    for b in range(got.shape[0]):
        dst = b * n
        for o in range(got.shape[1]):
            if got[b, o]:
                plan[m, 0], plan[m, 1], plan[m, 2], plan[m, 3] = o, src[o], dst, got[b, o]
                m += 1
            src[o] += drawn[b, o]
            dst += got[b, o]
    return plan[:m]


@numba.njit(cache=True, nogil=True)
def pack_updates(keys, prios, head, world, slot):  # pragma: no cover - compiled
    """The all_to_all block ``[world, len(head) + world + 2 * slot]`` of routed updates: row
    ``o`` holds ``head``, the count of ``keys`` (with their shard bits) owned by each
    shard, then up to ``slot`` of owner ``o``'s ``(key with shard 0, float64 priority
    bits)`` pairs; and every pair, ``[m, 2]`` ordered by owner (stably), and the counts."""
    h = head.shape[0]
    counts = np.zeros(world, np.int64)
    for i in range(keys.shape[0]):
        counts[keys[i] >> SHARD_SHIFT] += 1
    block = np.zeros((world, h + world + 2 * slot), np.int64)
    block[:, :h] = head
    block[:, h:h + world] = counts
    payload = np.empty((keys.shape[0], 2), np.int64)
    first = np.cumsum(counts) - counts
    at = first.copy()  # where owner o's next pair goes
    real = np.empty(1, np.float64)
    bits = real.view(np.int64)
    for i in range(keys.shape[0]):
        o = keys[i] >> SHARD_SHIFT
        real[0] = prios[i]
        payload[at[o], 0], payload[at[o], 1] = keys[i] & LOCAL_MASK, bits[0]
        j = at[o] - first[o]
        if j < slot:
            block[o, h + world + 2 * j], block[o, h + world + 2 * j + 1] = payload[at[o], 0], bits[0]
        at[o] += 1
    return block, payload, counts


@numba.njit(cache=True, nogil=True)
def unpack_updates(got, h, me, slot, extra, rest):  # pragma: no cover - compiled
    """The updates for shard ``me`` in the gathered blocks ``got`` (see :func:`pack_updates`)
    and in ``extra`` (``rest[r]`` pairs past the slot from each rank ``r``, in rank order):
    keys and float32 priorities, each sender's in its order, senders in rank order."""
    world = got.shape[0]
    m = extra.shape[0]
    for r in range(world):
        m += min(got[r, h + me], slot)
    keys, prios = np.empty(m, np.int64), np.empty(m, np.float32)
    bits = np.empty(1, np.int64)
    real = bits.view(np.float64)
    i = e = 0
    for r in range(world):
        for j in range(min(got[r, h + me], slot)):
            keys[i], bits[0] = got[r, h + world + 2 * j], got[r, h + world + 2 * j + 1]
            prios[i] = real[0]
            i += 1
        for _ in range(rest[r]):
            keys[i], bits[0] = extra[e, 0], extra[e, 1]
            prios[i] = real[0]
            i, e = i + 1, e + 1
    return keys, prios
