"""A brute-force model of the core buffer, written from docs/semantics.md alone (no library kernels).

Every stream keeps its full history as a Python list; validity, windows, keys,
probabilities and weights are recomputed from scratch on every question. Slow and
obviously right, which is the point: the tests compare the buffer against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shardreplay import Field, Spec
from shardreplay.spec.keys import GEN_MASK, unpack_keys

FIRST, MID, LAST = 0, 1, 2

# A small spec whose values name the step: obs = [row, position], act = global counter.
SPEC = Spec({"obs": Field((2,), np.float32), "act": Field((), np.int64)})


@dataclass
class RefStep:
    """One step as the reference keeps it."""

    step_type: int
    discount: float
    obs: tuple[float, float]
    act: int
    episode: int  # reference episode label (not the library's id)
    priority: float


@dataclass
class RefBuffer:
    """The whole history of every stream, and sampling rules 1-4 of docs/semantics.md.

    Priorities follow rule 3: a new step gets the writer's priority, else the largest
    priority seen so far (initially 1); ``update`` sets it for current starts only.
    """

    num_streams: int
    capacity: int
    window: int
    streams: list[list[RefStep]] = field(default_factory=list)
    max_priority: float = 1.0
    next_episode: int = 0
    next_act: int = 0
    fifo: list[tuple[int, int]] = field(default_factory=list)
    tag: int = 0  # the buffer's key tag (spec/keys.py): the reference cannot draw it

    def __post_init__(self) -> None:
        self.streams = [[] for _ in range(self.num_streams)]

    # -- writing ------------------------------------------------------------------------
    def write(self, rows: list[int], types: np.ndarray, discounts: np.ndarray,
              priorities: np.ndarray | None) -> dict[str, np.ndarray]:
        """Record ``types[i, t]`` for ``rows[i]``; returns the arrays to give the buffer."""
        n_rows, t_len = types.shape
        obs = np.zeros((n_rows, t_len, 2), np.float32)
        act = np.zeros((n_rows, t_len), np.int64)
        if priorities is not None:
            prios32 = np.asarray(priorities, np.float32).reshape(n_rows, t_len)
            self.max_priority = max(self.max_priority, float(prios32.max()))
        for i, r in enumerate(rows):
            before = self.valid_positions(r)
            hist = self.streams[r]
            for t in range(t_len):
                st = int(types[i, t])
                if not hist or st == FIRST or hist[-1].step_type == LAST:
                    ep = self.next_episode
                    self.next_episode += 1
                else:
                    ep = hist[-1].episode
                prio = float(prios32[i, t]) if priorities is not None else self.max_priority
                obs[i, t] = (r, len(hist))
                act[i, t] = self.next_act
                hist.append(RefStep(st, float(discounts[i, t]), (float(r), float(len(hist))),
                                    self.next_act, ep, prio))
                self.next_act += 1
            self.fifo.extend((r, q) for q in sorted(self.valid_positions(r) - before))
        return {"obs": obs, "act": act}

    # -- validity -----------------------------------------------------------------------
    def stored(self, r: int) -> range:
        """Absolute positions of the stored steps of stream ``r``."""
        n = len(self.streams[r])
        return range(max(0, n - self.capacity), n)

    def is_valid(self, r: int, q: int) -> bool:
        """docs/semantics.md, sampling rule 1, by enumeration."""
        hist = self.streams[r]
        if q not in self.stored(r):
            return False
        if self.window == 1:
            return True
        if hist[q].step_type == LAST:
            return False
        for k in range(1, self.window):
            if q + k >= len(hist) or hist[q + k].episode != hist[q].episode:
                return False
            if hist[q + k].step_type == LAST:
                return True
        return True

    def valid_positions(self, r: int) -> set[int]:
        """Valid absolute starts of stream ``r``."""
        return {q for q in self.stored(r) if self.is_valid(r, q)}

    def valid_starts(self) -> list[tuple[int, int]]:
        """Every valid (row, position), row-major."""
        return [(r, q) for r in range(self.num_streams) for q in sorted(self.valid_positions(r))]

    def flat(self, r: int, q: int) -> int:
        """Flat slot of (row, absolute position)."""
        return r * self.capacity + q % self.capacity

    def valid_slots(self) -> set[int]:
        """Flat slots of the valid starts."""
        return {self.flat(r, q) for r, q in self.valid_starts()}

    @property
    def num_steps(self) -> int:
        """Stored steps."""
        return sum(len(self.stored(r)) for r in range(self.num_streams))

    # -- keys and windows ---------------------------------------------------------------
    def position_of(self, r: int, slot: int) -> int:
        """The stored absolute position at ring slot ``slot`` of stream ``r``."""
        (q,) = [q for q in self.stored(r) if q % self.capacity == slot]
        return q

    def key(self, r: int, q: int) -> int:
        """The key docs/semantics.md and spec/keys.py prescribe: shard 0 (bits 53-62), the tag
        (bits 39-52), the place ``row * capacity + slot`` (bits 11-38), the low 11 bits
        of the slot's write count (bits 0-10)."""
        generation = (q // self.capacity + 1) & GEN_MASK
        return (self.tag << 39) | ((r * self.capacity + q % self.capacity) << 11) | generation

    def decode(self, key: int) -> tuple[int, int]:
        """(row, position) named by a key of this buffer (shard 0, its tag)."""
        shard, tag, place, _gen = (int(a[0]) for a in unpack_keys(np.array([key], np.int64)))
        assert shard == 0 and tag == self.tag
        row, slot = divmod(place, self.capacity)
        return row, self.position_of(row, slot)

    def window_of(self, r: int, q: int) -> tuple[list[RefStep], list[bool]]:
        """The steps of the window at (r, q) and its mask (padding repeats the LAST step)."""
        hist = self.streams[r]
        steps, mask, ended = [], [], False
        for k in range(self.window):
            if ended:
                steps.append(steps[-1])
                mask.append(False)
            else:
                steps.append(hist[q + k])
                mask.append(True)
                ended = hist[q + k].step_type == LAST
        return steps, mask

    # -- priorities ---------------------------------------------------------------------
    def probabilities(self, alpha: float) -> dict[tuple[int, int], float]:
        """P(i) = p_i^alpha / sum p^alpha over valid starts; priority 0 is never drawn."""
        mass = {}
        for r, q in self.valid_starts():
            p = np.float64(np.float32(self.streams[r][q].priority))
            mass[(r, q)] = float(p ** alpha) if p > 0 else 0.0
        total = sum(mass.values())
        return {i: (m / total if total > 0 else 0.0) for i, m in mass.items()}

    def weights(self, alpha: float, beta: float) -> dict[tuple[int, int], float]:
        """w_i = (N P(i))^-beta / max_j (N P(j))^-beta, max over all valid starts with P > 0."""
        probs = self.probabilities(alpha)
        n = len(probs)
        raw = {i: (n * p) ** -beta for i, p in probs.items() if p > 0}
        top = max(raw.values())
        return {i: w / top for i, w in raw.items()}

    def update(self, r: int, q: int, priority: float) -> None:
        """Apply an update to a current start."""
        self.streams[r][q].priority = float(np.float32(priority))
        self.max_priority = max(self.max_priority, float(np.float32(priority)))

    # -- fifo ---------------------------------------------------------------------------
    def fifo_waiting(self) -> list[tuple[int, int]]:
        """Windows waiting in the order they became valid (overwritten ones dropped)."""
        self.fifo = [(r, q) for r, q in self.fifo if q in self.stored(r)]
        return self.fifo

    def fifo_pop(self, n: int) -> list[tuple[int, int]]:
        """The ``n`` oldest waiting windows, removed."""
        out, self.fifo = self.fifo_waiting()[:n], self.fifo_waiting()[n:]
        return out


def check_batch(ref: RefBuffer, batch, episode_map: dict[int, int]) -> list[tuple[int, int]]:
    """Assert each sampled window equals the reference window; returns (row, pos) drawn.

    ``episode_map`` maps the reference's episode labels to the buffer's episode ids and
    must stay one-to-one across calls.
    """
    drawn = []
    keys = batch.keys.numpy()
    for b, key in enumerate(keys.tolist()):
        r, q = ref.decode(key)
        assert ref.is_valid(r, q), f"drew invalid start row {r} pos {q}"
        assert key == ref.key(r, q), "key generation differs from the slot's write count"
        steps, mask = ref.window_of(r, q)
        assert batch.mask[b].tolist() == mask
        np.testing.assert_array_equal(batch.data["obs"][b].numpy(),
                                      np.array([s.obs for s in steps], np.float32))
        assert batch.data["act"][b].tolist() == [s.act for s in steps]
        assert batch.data["step_type"][b].tolist() == [s.step_type for s in steps]
        np.testing.assert_array_equal(batch.data["discount"][b].numpy(),
                                      np.array([s.discount for s in steps], np.float32))
        for s, lib_ep in zip(steps, batch.data["episode_id"][b].tolist(), strict=True):
            assert episode_map.setdefault(s.episode, lib_ep) == lib_ep, "episode id changed"
        drawn.append((r, q))
    ids = list(episode_map.values())
    assert len(set(ids)) == len(ids), "two reference episodes share one episode id"
    return drawn
