"""Plain-numpy references of the compiled kernels, for the differential tests in this
directory: each gives what its kernel gives, computed from the definition (or by plain
indexing) rather than with the kernel's speed tricks. The twins of the checks that a process
runs before numba loads (an actor's checks) are in src/shardreplay/kernels/reference/."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from shardreplay.kernels.codes import GEN_BITS, PLACE_BITS, SHARD_BITS, TAG_BITS
from shardreplay.kernels.sum_tree import ARITY

FIRST, LAST = 0, 2

# -- kernels/keys.py ------------------------------------------------------------------------

_WIDTHS = (("shard", SHARD_BITS), ("tag", TAG_BITS), ("place", PLACE_BITS), ("generation", GEN_BITS))


def encode_keys(shard: np.ndarray, tag: np.ndarray, place: np.ndarray, generation: np.ndarray) -> np.ndarray:
    """Fields laid side by side, most significant first, by multiplication."""
    key = np.zeros(place.shape[0], np.int64)
    for (_name, bits), values in zip(_WIDTHS, (shard, tag, place, generation), strict=True):
        key = key * (1 << bits) + (np.asarray(values, np.int64) % (1 << bits))
    return key


def decode_keys(keys: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(shard, tag, place, generation)`` by division, least significant field first."""
    rest = np.asarray(keys, np.int64).copy()
    out = []
    for _name, bits in reversed(_WIDTHS):
        out.append(rest % (1 << bits))
        rest //= 1 << bits
    return tuple(reversed(out))


def key_fits(keys: np.ndarray, tag: int, size: int) -> np.ndarray:
    """Not negative, shard 0, tag ``tag``, place below ``size``."""
    shard, k_tag, place, _gen = decode_keys(np.maximum(keys, 0))
    return (keys >= 0) & (shard == 0) & (k_tag == tag) & (place < size)


def writes(pos: np.ndarray, slots: np.ndarray, cap: int) -> np.ndarray:
    """Times each flat slot was written: positions ``p < pos[row]`` with ``p % cap == slot``."""
    row, slot = np.divmod(slots, cap)
    return np.array([np.count_nonzero(np.arange(pos[r]) % cap == s) for r, s in zip(row, slot, strict=True)],
                    np.int64).reshape(-1)


def resolve_keys(keys: np.ndarray, priorities: np.ndarray, generation: np.ndarray, size: int,
                 epoch: int, tag: int) -> tuple[int, int, np.ndarray, np.ndarray]:
    """``(status, bad, slots, current)``: as kernels.keys.resolve_keys documents, with every
    key's slot and whether it is current (meaningful only when status is 0)."""
    bad_prio = ~(np.isfinite(priorities) & (priorities >= 0))
    bad_key = ~key_fits(keys, tag, size)
    first = np.flatnonzero(bad_prio | bad_key)
    if first.size:
        j = int(first[0])
        return (1 if bad_prio[j] else 2), j, np.empty(0, np.int64), np.empty(0, bool)
    _shard, _tag, slots, gen = decode_keys(keys)
    written = generation[slots].astype(np.int64)
    return 0, -1, slots, (written > 0) & ((written + epoch) % (1 << GEN_BITS) == gen)


def split_updates(keys: np.ndarray, prios: np.ndarray, rank: int, tags: np.ndarray, size: int) -> tuple:
    """As kernels.keys.split_updates documents: the first bad entry, else own keys
    (shard bits cleared) and foreign keys, padding (-1) dropped, order kept."""
    for i in range(keys.shape[0]):
        if not (np.isfinite(prios[i]) and prios[i] >= 0):
            return 1, i
        k = int(keys[i])
        if k == -1:
            continue
        shard, k_tag, place, _gen = (int(x[0]) for x in decode_keys(np.array([max(k, 0)])))
        if k < 0 or shard >= tags.shape[0] or k_tag != tags[shard] or (shard == rank and place >= size):
            return 2, i
    keep = keys != -1
    own = keep & (decode_keys(np.maximum(keys, 0))[0] == rank)
    foreign = keep & ~own
    local = keys[own] % (1 << (TAG_BITS + PLACE_BITS + GEN_BITS))
    return 0, -1, local, prios[own].astype(np.float32), keys[foreign], prios[foreign].astype(np.float32)


# -- kernels/storage.py and kernels/windows.py ----------------------------------------------


def write_steps(step_type: np.ndarray, episode_id: np.ndarray, generation: np.ndarray,
                priority: np.ndarray, valid: np.ndarray, pos: np.ndarray, counters: np.ndarray,
                rows: np.ndarray, types: np.ndarray, prios: np.ndarray, has_prios: bool,
                default_prio: float, cap: int, window: int, out_slots: np.ndarray,
                out_flags: np.ndarray) -> tuple[int, int]:
    """``kernels.storage.write_steps`` vectorised over steps and rows: same arguments, effects
    and results (``rows`` distinct, ``types.shape[1] <= cap``, as the compiled one requires)."""
    n_rows, t_len = types.shape
    rows = rows.astype(np.int64, copy=False)
    p0 = pos[rows]
    base = rows * cap
    slots = base[:, None] + (p0[:, None] + np.arange(t_len)) % cap
    if t_len:
        _write_episodes(step_type, episode_id, counters, types, p0, base, slots, cap)
    flat = slots.reshape(-1)
    step_type[flat] = types.reshape(-1)
    generation[flat] += 1
    priority[flat] = prios.reshape(-1) if has_prios else default_prio
    delta = -int(np.count_nonzero(valid[flat]))
    valid[flat] = False
    out_slots[0, :flat.shape[0]] = flat
    p1 = p0 + t_len
    pos[rows] = p1
    # Starts whose validity the write may change (docs/internals.md, "Stream storage"), row by row.
    lo = np.maximum(np.maximum(p0 - window + 1, p1 - cap), 0)
    counts = p1 - lo
    n_out = int(counts.sum())
    which = np.repeat(np.arange(n_rows), counts)
    q = np.repeat(lo - np.cumsum(counts) + counts, counts) + np.arange(n_out)
    q_base, q_p1 = base[which], p1[which]
    q_slot = q_base + q % cap
    was = valid[q_slot] & (q < p0[which])
    now = _valid_starts(step_type, episode_id, q, q_base, q_p1, cap, window)
    delta += int(np.count_nonzero(now)) - int(np.count_nonzero(valid[q_slot]))
    valid[q_slot] = now
    out_slots[1, :n_out] = q_slot
    out_flags[0, :n_out] = now
    out_flags[1, :n_out] = now & ~was
    return n_out, delta


def _write_episodes(step_type: np.ndarray, episode_id: np.ndarray, counters: np.ndarray,
                    types: np.ndarray, p0: np.ndarray, base: np.ndarray, slots: np.ndarray,
                    cap: int) -> None:
    """Episode ids of the written steps: a step opens a new episode (the next id, in row
    then time order) at position 0, at FIRST, or after a LAST; any other continues the
    episode of the step before it (stored, for a row's first written step)."""
    prev = base + (p0 - 1) % cap  # read before anything is written (t_len <= cap)
    new = np.empty(types.shape, np.bool_)
    new[:, 0] = (p0 == 0) | (types[:, 0] == FIRST) | (step_type[prev] == LAST)
    new[:, 1:] = (types[:, 1:] == FIRST) | (types[:, :-1] == LAST)
    new_ids = (counters[0] - 1 + np.cumsum(new.reshape(-1))).reshape(new.shape)
    counters[0] += np.count_nonzero(new)
    # Each step takes the id of the latest new episode at or before it in its row.
    opened = np.maximum.accumulate(np.where(new, np.arange(types.shape[1]), -1), axis=1)
    inherited = np.take_along_axis(new_ids, np.maximum(opened, 0), axis=1)
    episode_id[slots] = np.where(opened >= 0, inherited, episode_id[prev][:, None])


def _valid_starts(step_type: np.ndarray, episode_id: np.ndarray, q: np.ndarray, q_base: np.ndarray,
                  q_p1: np.ndarray, cap: int, window: int) -> np.ndarray:
    """Validity of absolute starts ``q`` (rows at ``q_base``, written up to ``q_p1``), as
    ``kernels.storage._is_valid_at``: one vector step per window position."""
    if window == 1:
        return np.ones(q.shape[0], np.bool_)
    first = q_base + q % cap
    episode = episode_id[first]
    now = step_type[first] != LAST
    open_ = now.copy()  # not decided yet
    for k in range(1, window):
        nxt = q_base + (q + k) % cap
        fail = open_ & ((q + k >= q_p1) | (episode_id[nxt] != episode))
        now &= ~fail
        open_ &= ~fail & (step_type[nxt] != LAST)  # a LAST inside the window closes it: valid
    return now


def scatter_fields(pairs: tuple[tuple[np.ndarray, np.ndarray], ...], slots: np.ndarray) -> None:
    """``kernels.storage.scatter_fields``: step ``i`` of each value to row
    ``slots[i]`` of its ``[N, k]`` uint8 destination."""
    n = slots.shape[0]
    for dst, value in pairs:
        dst[slots] = value.reshape(-1).view(np.uint8).reshape(n, dst.shape[1])



def validity(step_type: np.ndarray, episode_id: np.ndarray, pos: np.ndarray, cap: int,
             window: int) -> np.ndarray:
    """Valid flag of every flat slot (kernels/storage.py's module docstring): every stored
    start judged by :func:`_valid_starts`."""
    lengths = np.minimum(pos, cap)
    row = np.repeat(np.arange(pos.shape[0]), lengths)
    q = np.repeat(pos - lengths - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))
    valid = np.zeros(pos.shape[0] * cap, bool)
    valid[row * cap + q % cap] = _valid_starts(step_type, episode_id, q, row * cap, pos[row], cap, window)
    return valid


def window_indices(starts, step_type, generation, cap, window, epoch, tag):
    """``(idx [B, L], mask [B, L], keys [B])`` of valid starts (kernels/windows.py's walk):
    positions after a LAST inside the window repeat the LAST's slot and are masked."""
    n = starts.shape[0]
    idx = np.empty((n, window), np.int64)
    mask = np.ones((n, window), bool)
    for b, s in enumerate(starts):
        base = s - s % cap
        slots = base + (s - base + np.arange(window)) % cap
        ends = np.flatnonzero(step_type[slots[1:]] == LAST)
        if ends.size:
            end = ends[0] + 1
            slots[end + 1:] = slots[end]
            mask[b, end + 1:] = False
        idx[b] = slots
    gens = generation[starts].astype(np.int64) + epoch
    keys = encode_keys(np.zeros(n, np.int64), np.full(n, tag), starts.astype(np.int64), gens)
    return idx, mask, keys


def gather_window_parts(sources, out_offset, idx, dst_rows, out):
    """Window ``b`` of part ``p`` (``[L, k]`` bytes) into row ``dst_rows[b]`` of ``out`` at
    byte ``out_offset[p]``."""
    for src, offset in zip(sources, out_offset, strict=True):
        k = src.shape[1]
        out[dst_rows, offset:offset + idx.shape[1] * k] = src[idx].reshape(idx.shape[0], idx.shape[1] * k)


# -- kernels/frames.py ----------------------------------------------------------------------

def stack(frames: np.ndarray, row: int, ref: int, k: int) -> np.ndarray:
    """The ``[K, frame bytes]`` stack whose newest frame is at position ``ref`` of ``row``."""
    return frames[row, (ref - k + 1 + np.arange(k)) % frames.shape[1]]


def gather_stacks_rows(idx, cap, ref, frames, k, dst_rows, out, offset):
    """Stacks of every slot of ``idx [B, L]`` into rows ``dst_rows`` of ``out`` at ``offset``."""
    fb = frames.shape[2]
    for b in range(idx.shape[0]):
        stacks = [stack(frames, int(s) // cap, int(ref[s]), k) for s in idx[b]]
        out[dst_rows[b], offset:offset + idx.shape[1] * k * fb] = np.concatenate(stacks).reshape(-1)


def new_counts(values, types, rows, pos, step_type, ref, frames, cap):
    """Frames each step appends (1 when its stack continues the stored or previous one,
    else K), or ``(i, t)`` of the first step that continues its episode but not its stack."""
    n, t_len, k = values.shape[:3]
    counts = np.empty((n, t_len), np.int64)
    for i in range(n):
        r, p0 = int(rows[i]), int(pos[rows[i]])
        for t in range(t_len):
            if t == 0:
                prev_slot = r * cap + (p0 - 1) % cap
                has_prev = p0 > 0
                cont = has_prev and types[i, 0] != FIRST and step_type[prev_slot] != LAST
                prev = stack(frames, r, int(ref[prev_slot]), k) if has_prev else None
            else:
                cont = types[i, t] != FIRST and types[i, t - 1] != LAST
                prev = values[i, t - 1]
            same = prev is not None and np.array_equal(values[i, t, :k - 1], prev[1:])
            if cont and not same:
                return i, t
            counts[i, t] = 1 if same else k
    return counts


def append_frames(values, rows, written, counts, frames, ref, fpos):
    """Append each step's new frames (its newest one, or its whole stack) and record its ref."""
    t_len, k = values.shape[1], values.shape[2]
    for i, r in enumerate(rows):
        for t in range(t_len):
            for j in range(k - int(counts[i, t]), k):
                frames[r, fpos[r] % frames.shape[1]] = values[i, t, j]
                fpos[r] += 1
            ref[written[i * t_len + t]] = fpos[r] - 1


# -- kernels/sampling.py, kernels/plan.py, kernels/returns.py -------------------------------

def draw_written(raw: np.ndarray, pos: np.ndarray, cap: int, valid: np.ndarray, out: np.ndarray,
                 got: int) -> int:
    """Valid written slots of the raw words' top bits appended in order to ``out[got:]``
    until it is full; the new fill count."""
    lengths = np.minimum(pos, cap)
    total = int(lengths.sum())
    if total == 0:
        return got
    bits = (total - 1).bit_length()
    ordinals = (raw >> np.uint64(64 - bits)).astype(np.int64) if bits else np.zeros(raw.shape, np.int64)
    ordinals = ordinals[ordinals < total]
    ends = np.cumsum(lengths)
    row = np.searchsorted(ends, ordinals, side="right")
    slots = row * cap + ordinals - (ends - lengths)[row]
    take = slots[valid[slots]][:out.shape[0] - got]
    out[got:got + take.shape[0]] = take
    return got + take.shape[0]


def balance_longest_first(order: np.ndarray, sizes: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Each item in ``order`` to the bin least filled for its capacity, the lowest of ties."""
    filled = [0] * caps.shape[0]
    assign = np.zeros(sizes.shape[0], np.int64)
    for i in order:
        b = min(range(caps.shape[0]), key=lambda j: (Fraction(filled[j], int(caps[j])), j))
        assign[i] = b
        filled[b] += int(sizes[i])
    return assign


def track_returns(rows, reward, step_type, running, last_return):
    """Returns of the episodes a chunk finishes, in time order (``running`` and
    ``last_return`` updated in place)."""
    finished = []
    for t in range(step_type.shape[1]):
        for i, r in enumerate(rows):
            if step_type[i, t] == FIRST:
                running[r] = 0.0
            if step_type[i, t] == LAST:
                finished.append(running[r])
                last_return[r] = running[r]
            else:
                running[r] += reward[i, t]
    return np.array(finished)


# -- kernels/sum_tree.py --------------------------------------------------------------------

def level_sums(leaves: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    """Every level, root first: each node the in-order sum of its ``ARITY`` children."""
    levels = [np.asarray(leaves, np.float64)]
    for size in sizes[-2::-1]:
        child = levels[0]
        padded = np.zeros(int(size) * ARITY)
        padded[:child.shape[0]] = child
        levels.insert(0, np.cumsum(padded.reshape(-1, ARITY), axis=1)[:, -1])
    return levels


def level_mins(leaves: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    """Every level above the leaves, root first: each node the smallest positive leaf
    below it, inf when none."""
    levels = [np.where(np.asarray(leaves, np.float64) > 0, leaves, np.inf)]
    for size in sizes[-2::-1]:
        padded = np.full(int(size) * ARITY, np.inf)
        padded[:levels[0].shape[0]] = levels[0]
        levels.insert(0, padded.reshape(-1, ARITY).min(axis=1))
    return levels[:-1]


def find_prefix(leaves: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """The leaf ``i`` with ``sum(leaves[:i]) <= u < sum(leaves[:i+1])`` (so never a zero
    leaf), for targets below the total (the kernel maps the others, which only rounding
    makes, to some positive leaf)."""
    return np.searchsorted(np.cumsum(leaves), targets, side="right")


def min_positive(leaves: np.ndarray) -> float:
    """The smallest positive leaf, inf when none."""
    positive = leaves[leaves > 0]
    return float(positive.min()) if positive.size else float("inf")


def leaves_from_priorities(valid: np.ndarray, priority: np.ndarray, alpha: float) -> np.ndarray:
    """``priority^alpha`` where valid and positive, else 0 (C's pow, as compiled code uses)."""
    return np.array([float(p) ** alpha if v and p > 0 else 0.0 for v, p in zip(valid, priority, strict=True)])


def draw_weighted(leaves: np.ndarray, uniforms: np.ndarray, beta: float) -> tuple[np.ndarray, ...]:
    """Leaves for uniforms in [0, 1), ``P = leaf / total`` and ``w = (leaf / min)^-beta``."""
    total = np.cumsum(leaves)[-1]
    starts = find_prefix(leaves, uniforms * total)  # uniforms * total < total here
    v = leaves[starts]
    return starts, v / total, ((v / min_positive(leaves)) ** -beta).astype(np.float32)
