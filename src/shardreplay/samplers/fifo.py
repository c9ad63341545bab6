"""FIFO sampling: drain windows in the order they became valid (on-policy use)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

from shardreplay.samplers.base import Draw, Unweighted, check_state_keys, state_error
from shardreplay.storage import StreamStorage


class FifoSampler(Unweighted):
    """Returns each valid window once, oldest first.

    A window enters the queue when it becomes valid; one that was overwritten before
    it was drained is skipped. ``len(buffer)`` counts the windows not yet drained.
    ``draw(n)`` returns at most ``n`` windows: fewer when fewer are waiting.
    Probabilities are ``1 / waiting`` at the time of the draw, weights 1.
    """

    name = "fifo"

    def __init__(self, storage: StreamStorage) -> None:
        self.storage = storage
        self._queue: deque[tuple[np.ndarray, np.ndarray]] = deque()  # (slots, generations)
        self._waiting = 0

    def on_write(self, slots: np.ndarray, valid: np.ndarray, newly: np.ndarray) -> None:
        """Queue the windows that became valid, in slot order of this write."""
        fresh = slots[newly]
        if fresh.size:
            self._queue.append((fresh, self.storage.generation[fresh].copy()))
            self._waiting += int(fresh.size)

    def num_samplable(self) -> int:
        """Windows waiting to be drained (overwritten ones are discounted lazily)."""
        self._prune_all()
        return self._waiting

    def _prune_all(self) -> None:
        kept: deque[tuple[np.ndarray, np.ndarray]] = deque()
        waiting = 0
        for slots, gens in self._queue:
            live = self.storage.generation[slots] == gens
            if live.any():
                kept.append((slots[live], gens[live]))
                waiting += int(live.sum())
        self._queue, self._waiting = kept, waiting

    def mass(self) -> float:
        """Number of waiting windows."""
        return float(self.num_samplable())

    def draw(self, n: int, rng: np.random.Generator, advance: bool = True) -> Draw:
        """Pop up to ``n`` of the oldest waiting windows."""
        waiting = self.num_samplable()
        taken: list[np.ndarray] = []
        count = 0
        while self._queue and count < n:
            slots, gens = self._queue.popleft()
            take = min(n - count, slots.size)
            taken.append(slots[:take])
            if take < slots.size:
                self._queue.appendleft((slots[take:], gens[take:]))
            count += take
        self._waiting -= count
        starts = np.concatenate(taken) if taken else np.empty(0, np.int64)
        return Draw(starts, np.full(count, 1.0 / max(waiting, 1)), np.ones(count, np.float32))

    def rebuild(self) -> None:
        """After a load: every valid window waits, oldest (by row, time) first."""
        slots, _ = self.storage.stored_slots()
        self._wait_for(slots[self.storage.valid[slots]])

    def _wait_for(self, slots: np.ndarray) -> None:
        """Only ``slots`` wait, in this order."""
        self._queue = deque([(slots, self.storage.generation[slots].copy())]) if slots.size else deque()
        self._waiting = int(slots.size)

    def state_dict(self) -> dict[str, Any]:
        """The waiting windows in order (flat slots and generations)."""
        self._prune_all()
        slots = np.concatenate([s for s, _ in self._queue]) if self._queue else np.empty(0, np.int64)
        return {"waiting_slots": slots}

    def check_state(self, state: Mapping[str, Any], steps: Mapping[str, np.ndarray]) -> None:
        """Check a state of :meth:`state_dict` against the steps it comes with.

        Raises:
            ConfigError: ``waiting_slots`` is not a 1-D integer array of distinct slots
                that are valid window starts of ``steps``, or the state has other entries.
        """
        check_state_keys(self.name, state, (), ("waiting_slots",))
        if "waiting_slots" not in state:
            return
        slots = state["waiting_slots"]
        what = "a 1-D integer array of distinct flat slots"
        if not isinstance(slots, np.ndarray) or slots.ndim != 1 or \
                (slots.dtype.kind not in "iu" and slots.size):
            raise state_error(self.name, "waiting_slots", what, slots)
        if slots.size == 0:
            return
        if slots.min() < 0 or slots.max() >= self.storage.size or np.unique(slots).size != slots.size:
            raise state_error(self.name, "waiting_slots", f"{what} in [0, {self.storage.size})", slots)
        if not self.storage.valid_after_import(steps)[slots].all():
            raise state_error(self.name, "waiting_slots", "valid window starts of the state's steps",
                              slots)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the waiting queue saved by :meth:`state_dict`."""
        if "waiting_slots" not in state:
            return  # keep what rebuild() queued
        self._wait_for(np.asarray(state["waiting_slots"], np.int64))
