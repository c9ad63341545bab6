"""The sharded exchange's bookkeeping: every requester's shard counts and the owner's write
of the record columns it fills (distributed/exact_exchange.py); the block of routed
priority updates and what arrives in it (distributed/priorities.py); the same-host
collectives' wait for the peers' generation counters, without the GIL (same_host.py)."""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.extending import intrinsic

from shardreplay.kernels.cache_lock import SMALL_CALL  # numba's cache, safe across processes
from shardreplay.kernels.codes import LOCAL_MASK, SHARD_SHIFT

binding.initialize_native_asmparser()  # the futex syscall's inline assembly needs it


_M32, _PCG = np.uint64(0xFFFFFFFF), np.uint64(4865540595714422341)  # PCG64's multiplier: its low word
_P0, _P1 = _PCG & _M32, _PCG >> np.uint64(32)


@numba.njit(cache=True)
def _hash(value, const, mult):  # pragma: no cover - compiled; SeedSequence's hashmix: hash, next const
    value = ((value ^ const) * (const * mult & _M32)) & _M32
    return value ^ (value >> np.uint64(16)), const * mult & _M32


@numba.njit(cache=True, nogil=True)
def uniforms(seed, shape):  # pragma: no cover - compiled
    """``np.random.default_rng(seed).random(shape)`` bit for bit (0 <= seed < 2^63), without its
    Python: SeedSequence's pool of 4 words, 8 words drawn from it seed PCG64 (XSL-RR), 53-bit doubles."""
    u64, pool, words, const = np.uint64, np.zeros(4, np.uint64), np.zeros(8, np.uint64), np.uint64(0x43b0d7e5)
    for i in range(4):  # uint32 words (as uint64s) throughout
        pool[i], const = _hash(u64(seed) >> u64(32 * i) & _M32 if i < 2 else u64(0), const, u64(0x931e8875))
    for src in range(4):
        for dst in range(4):
            if src != dst:
                h, const = _hash(pool[src], const, u64(0x931e8875))
                mixed = (u64(0xca01f9dd) * pool[dst] - u64(0x4973f715) * h) & _M32
                pool[dst] = mixed ^ (mixed >> u64(16))
    for i in range(8):
        words[i], const = _hash(pool[i % 4], u64(0x8b51f9dd) if i == 0 else const, u64(0x58f38ded))
    word = words[0::2] | words[1::2] << u64(32)  # seed high, low; increment high, low
    inc_hi, inc_lo = word[2] << u64(1) | word[3] >> u64(63), word[3] << u64(1) | u64(1)
    flat, hi, lo = np.empty(shape).reshape(-1), u64(0), u64(0)
    for i in range(-2, flat.size):  # two seeding steps (the seed added before the second), one a double
        hi, lo = (hi + word[0] + u64(lo + word[1] < lo), lo + word[1]) if i == -1 else (hi, lo)
        t = (lo >> u64(32)) * _P0 + ((lo & _M32) * _P0 >> u64(32))  # then t: the high word of lo * _PCG
        t = (lo >> u64(32)) * _P1 + (t >> u64(32)) + ((t & _M32) + (lo & _M32) * _P1 >> u64(32))
        low = lo * _PCG + inc_lo  # the 128-bit state * (2549297995355413924 << 64 | _PCG) + increment
        hi, lo = t + lo * u64(2549297995355413924) + hi * _PCG + inc_hi + u64(low < lo * _PCG), low
        if i >= 0:
            x, rot = hi ^ lo, hi >> u64(58)
            flat[i] = ((x >> rot | x << ((u64(64) - rot) & u64(63))) >> u64(11)) / 2.0**53
    return flat.reshape(shape)


@numba.njit(cache=True, nogil=True)
def counts(masses, batches, u, widen):  # pragma: no cover - compiled
    """Items per ``[requester r, batch, owner]``: each of ``r``'s batches takes
    Multinomial(``batches[r]``, masses / total) by the inverse CDF of the uniforms ``u``
    (the same on every rank, so the counts of nearby masses differ only where a uniform
    falls between them). ``widen``: each owner's share taken that much wider on both sides
    (the counts then bound those of masses whose CDF moved less than that)."""
    cum = np.cumsum(masses)
    last = np.flatnonzero(masses > 0)[-1]  # u * total may round up to the total: the last's
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
def plan(masses, batches, u, widen, me, head):  # pragma: no cover - compiled
    """The counts ``planned`` of ``masses`` (:func:`counts`; their total > 0), and of them,
    per rank ``r``: the rows each owner ``r`` draws in all, the rows ``me`` draws for
    requester ``r`` and where they start in its send buffer (``head`` rows before each
    requester's), where ``me``'s rows start in owner ``r``'s area, and how many they are
    (the rows of one ``[5, world]`` array); then the send buffer's rows ``me`` writes, in order."""
    planned = counts(masses, batches, u, widen)
    world = planned.shape[0]
    sizes = np.zeros((5, world), np.int64)  # one array returned, not five (each costs a boxing)
    owner_rows, sent, firsts, peer_first, mine = sizes[0], sizes[1], sizes[2], sizes[3], sizes[4]
    rows, at = np.empty(planned[:, :, me].sum(), np.int64), 0
    for r in range(world):
        for b in range(planned.shape[1]):
            for o in range(world):
                owner_rows[o] += planned[r, b, o]
                peer_first[o] += planned[r, b, o] if r < me else 0
                mine[o] += planned[r, b, o] if r == me else 0
            sent[r] += planned[r, b, me]
        firsts[r] = at + head
        rows[at - r * head:at - r * head + sent[r]] = np.arange(firsts[r], firsts[r] + sent[r])
        at += sent[r] + head
    return planned, sizes, rows


DONE, REDO, FALLBACK = 0, 1, 2  # what settle makes of an exchange's posts


@numba.njit(cache=True, nogil=True)
def settle(posts, masses, planned, batches, u, widen, spare, again):  # pragma: no cover - compiled
    """``(code, final counts, next widen, smallest leaf, largest priority)`` of the owners'
    ``posts`` (has a region, mass, smallest leaf, largest priority) for the counts ``planned``
    of ``masses`` (``spare``: ``widen`` wider; ``again``: final). ``code``: ``DONE``,
    ``FALLBACK`` (a rank has no region) or ``REDO`` (a batch short, or no mass left)."""
    new, code, final = posts[:, 1], DONE, planned
    if not (posts[:, 0] != 0).all():
        code = FALLBACK
    elif not again and (spare or (new != masses).any()):
        if not new.sum() > 0:
            code = REDO
        else:
            final = counts(new, batches, u, 0.0)
            if spare:  # next time: twice the largest move of a point of the normalised CDF
                widen = max(2 * np.abs(np.cumsum(new) / new.sum() - np.cumsum(masses) / masses.sum()).max(),
                            1e-4)
            code = REDO if (final > planned).any() else DONE
    return code, final, widen, posts[:, 2].min(), posts[:, 3].max()


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
def unpack_updates(got, h, me, slot, extra):  # pragma: no cover - compiled
    """The updates for shard ``me`` in the gathered blocks ``got`` (see :func:`pack_updates`)
    and in ``extra`` (the pairs past the slot from each rank, in rank order): keys and
    float32 priorities, each sender's in its order, senders in rank order."""
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
        for _ in range(got[r, h + me] - slot):
            keys[i], bits[0] = extra[e, 0], extra[e, 1]
            prios[i] = real[0]
            i, e = i + 1, e + 1
    return keys, prios


@intrinsic
def _load(typingctx, address):  # pragma: no cover - compiled
    """The uint32 at ``address``, read anew on every call (never hoisted out of a loop)."""
    def codegen(context, builder, sig, args):
        return builder.load_atomic(builder.inttoptr(args[0], ir.IntType(32).as_pointer()), "acquire", 4)
    return types.uint32(types.int64), codegen


@intrinsic
def futex(typingctx, address, op, value, timespec):  # pragma: no cover - compiled
    """The futex syscall (x86-64; inline assembly, so its callers stay cacheable): 0+ or -errno."""
    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        call = ir.InlineAsm(ir.FunctionType(i64, [i64] * 7), "syscall",
                            "={rax},{rax},{rdi},{rsi},{rdx},{r10},{r8},{r9},~{rcx},~{r11},~{memory}", True)
        return builder.call(call, [ir.Constant(i64, 202), *args, ir.Constant(i64, 0), ir.Constant(i64, 0)])
    return types.int64(types.int64, types.int64, types.int64, types.int64), codegen


@numba.njit(cache=True, nogil=True)
def wait_for(words, gen, slice_ns):  # pragma: no cover - compiled
    """-1 once the counter at every address ``words[r]`` shows generation ``gen`` (32-bit, wrapping);
    else the first ``r`` whose counter did not within a sleep of ``slice_ns`` (< 1 s) on it."""
    timespec = np.array([0, slice_ns], np.int64)
    for r in range(words.shape[0]):
        seen = _load(words[r])
        while (seen - gen) & 0xFFFFFFFF >= 0x80000000:
            if futex(words[r], 0, seen, timespec.ctypes.data) == -110:  # FUTEX_WAIT timed out (-ETIMEDOUT)
                return r
            seen = _load(words[r])
    return -1


@numba.njit(**SMALL_CALL)
def wake(address):  # pragma: no cover - compiled
    """Wake every thread asleep on the counter at ``address``."""
    return futex(address, 1, 1 << 30, 0)  # FUTEX_WAKE
