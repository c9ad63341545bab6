"""One adapter per library for the replay benchmark: the same calls, each in its native form.

Every adapter converts the workload's data to its library's input format in ``prepare``
(not timed), then offers ``create`` / ``add`` / ``sample`` / ``sample_for_update`` /
``update`` / ``learner_step``, which the benchmark times:

* shardreplay: ``ReplayBuffer(spec, num_streams=32, stream_capacity=31_250, window=2)``;
  ``add`` writes one step of each of the 32 streams (obs, action, reward, step_type,
  discount; no next_obs: a transition is a window of two stored steps); ``sample(256)``
  returns a ``Batch`` of torch tensors with importance weights; priorities are updated by
  the batch's keys with torch float32 tensors (what a learner's TD errors are).
* TorchRL: ``ReplayBuffer`` (``RandomSampler``) / ``PrioritizedReplayBuffer`` on a
  ``LazyTensorStorage``, fed ``TensorDict`` batches of 32; the prioritized sample is
  ``sample(return_info=True)`` (index and weights); ``update_priority(index, priority)``.
* cpprb: ``ReplayBuffer`` / ``PrioritizedReplayBuffer``; ``add(**arrays)``,
  ``sample(256)`` / ``sample(256, beta=0.4)``, ``update_priorities(indexes, priorities)``;
  no ``next_of`` frame sharing (the peers store the same fields).
"""

from __future__ import annotations

import importlib.metadata as im
from pathlib import Path
from typing import Any

import numpy as np
import replay_workload as W


class MissingLibrary(Exception):
    """The library of a case cannot be imported (or lacks what the case needs)."""


class ShardReplayCase:
    """shardreplay's ReplayBuffer, steps of 32 streams, windows of 2 steps."""

    name = "shardreplay"

    def __init__(self) -> None:
        try:
            import torch

            from shardreplay import Field, ReplayBuffer, Spec
        except ImportError as exc:
            raise MissingLibrary(f"shardreplay: {exc}") from exc
        self._torch, self._buffer_cls = torch, ReplayBuffer
        self._spec = Spec(
            {
                "obs": Field((W.OBS_DIM,), np.float32),
                "action": Field((), np.int64),
                "reward": Field((), np.float32),
            }
        )
        self.buf: Any = None

    def versions(self) -> dict[str, Any]:
        """Versions of the library and of what it runs on."""
        import shardreplay

        return {"version": im.version("shardreplay"), "source": str(Path(shardreplay.__file__).parent),
                "torch": self._torch.__version__, "torch_threads": self._torch.get_num_threads()}

    def prepare(self, pool: dict[str, np.ndarray], seed: int) -> None:
        """Steps per call with step types and discounts; priorities as torch tensors."""
        batches = W.split_batches(pool)
        done = np.stack([b["done"] for b in batches])
        # The first pass starts every stream; later passes follow the previous pass's end.
        self._types = (W.step_types(done, first_call=True), W.step_types(done, first_call=False))
        self._steps = [[self._step(b, t[i]) for i, b in enumerate(batches)] for t in self._types]
        self._prios = [self._torch.from_numpy(p) for p in W.random_priorities()]
        self._seed = seed

    @staticmethod
    def _step(batch: dict[str, np.ndarray], types: np.ndarray) -> dict[str, np.ndarray]:
        # done is taken as a termination, so the LAST step's discount is 0.
        discount = np.where(types == W.LAST, 0.0, 1.0).astype(np.float32)
        return {"obs": batch["obs"], "action": batch["action"], "reward": batch["reward"],
                "step_type": types, "discount": discount}

    def create(self, mode: str, capacity: int = W.CAPACITY) -> None:
        """A buffer of exactly ``capacity`` steps (32 streams)."""
        self.buf = self._buffer_cls(
            self._spec, num_streams=W.ADD_BATCH, stream_capacity=capacity // W.ADD_BATCH,
            window=2, sampler=mode, alpha=W.ALPHA, beta=W.BETA, seed=self._seed,
        )

    def add(self, i: int) -> None:
        """One step of every stream."""
        n = len(self._steps[0])
        self.buf.add(self._steps[0 if i < n else 1][i % n])

    def stored(self) -> dict[str, Any]:
        """Stored steps and sampleable windows."""
        return {"stored": int(self.buf.num_steps), "valid_windows": len(self.buf)}

    def sample(self) -> Any:
        """A batch of 256 windows (with weights when prioritized)."""
        return self.buf.sample(W.SAMPLE_BATCH)

    def sample_for_update(self) -> Any:
        """The keys of a fresh batch of 256."""
        return self.buf.sample(W.SAMPLE_BATCH).keys

    def update(self, keys: Any, i: int) -> None:
        """New priorities for 256 keys."""
        self.buf.update_priorities(keys, self._prios[i % len(self._prios)])

    def learner_step(self, i: int) -> None:
        """Sample 256, then update exactly their priorities."""
        batch = self.buf.sample(W.SAMPLE_BATCH)
        self.buf.update_priorities(batch.keys, self._prios[i % len(self._prios)])


class TorchRLCase:
    """TorchRL ReplayBuffer / PrioritizedReplayBuffer on a LazyTensorStorage."""

    name = "torchrl"

    def __init__(self) -> None:
        try:
            import tensordict
            import torch
            import torchrl.data as rl_data
        except ImportError as exc:
            raise MissingLibrary(f"torchrl: {exc}") from exc
        self._torch, self._td, self._rl = torch, tensordict, rl_data
        self.buf: Any = None

    def versions(self) -> dict[str, Any]:
        """Versions of the library and of what it runs on."""
        return {"version": im.version("torchrl"), "tensordict": im.version("tensordict"),
                "torch": self._torch.__version__, "torch_threads": self._torch.get_num_threads()}

    def prepare(self, pool: dict[str, np.ndarray], seed: int) -> None:
        """TensorDicts of 32 transitions; priorities as torch tensors."""
        tensors = {k: self._torch.from_numpy(v) for k, v in pool.items()}
        n = len(pool["reward"]) // W.ADD_BATCH
        self._batches = [
            self._td.TensorDict({k: v[i * W.ADD_BATCH : (i + 1) * W.ADD_BATCH] for k, v in tensors.items()},
                                batch_size=[W.ADD_BATCH])
            for i in range(n)
        ]
        self._prios = [self._torch.from_numpy(p) for p in W.random_priorities()]
        self._torch.manual_seed(seed)

    def create(self, mode: str, capacity: int = W.CAPACITY) -> None:
        """A buffer of ``capacity`` transitions (storage allocated at the first extend)."""
        storage = self._rl.LazyTensorStorage(capacity)
        if mode == "uniform":
            self.buf = self._rl.ReplayBuffer(storage=storage, sampler=self._rl.RandomSampler(),
                                             batch_size=W.SAMPLE_BATCH)
            return
        try:
            import torchrl._torchrl  # noqa: F401  the sum tree lives in the C++ extension
        except ImportError as exc:
            raise MissingLibrary(f"torchrl._torchrl does not load (rebuild it: make bench): {exc}") from exc
        self.buf = self._rl.PrioritizedReplayBuffer(alpha=W.ALPHA, beta=W.BETA, storage=storage,
                                                    batch_size=W.SAMPLE_BATCH)

    def add(self, i: int) -> None:
        """32 transitions."""
        self.buf.extend(self._batches[i % len(self._batches)])

    def stored(self) -> dict[str, Any]:
        """Stored transitions."""
        return {"stored": len(self.buf)}

    def sample(self) -> Any:
        """256 transitions (with index and weights when prioritized)."""
        if isinstance(self.buf, self._rl.PrioritizedReplayBuffer):
            return self.buf.sample(return_info=True)
        return self.buf.sample()

    def sample_for_update(self) -> Any:
        """The indices of a fresh batch of 256."""
        return self.buf.sample(return_info=True)[1]["index"]

    def update(self, index: Any, i: int) -> None:
        """New priorities for 256 indices."""
        self.buf.update_priority(index, self._prios[i % len(self._prios)])

    def learner_step(self, i: int) -> None:
        """Sample 256, then update exactly their priorities."""
        _, info = self.buf.sample(return_info=True)
        self.buf.update_priority(info["index"], self._prios[i % len(self._prios)])


class CpprbCase:
    """cpprb ReplayBuffer / PrioritizedReplayBuffer (numpy storage, allocated at creation)."""

    name = "cpprb"

    def __init__(self) -> None:
        try:
            import cpprb
        except ImportError as exc:
            raise MissingLibrary(f"cpprb: {exc}") from exc
        self._cpprb = cpprb
        self.buf: Any = None

    def versions(self) -> dict[str, Any]:
        """Version of the library."""
        return {"version": im.version("cpprb")}

    def prepare(self, pool: dict[str, np.ndarray], seed: int) -> None:
        """Dicts of 32-row numpy arrays; priorities as numpy arrays."""
        self._batches = W.split_batches(pool)
        self._prios = W.random_priorities()
        np.random.seed(seed)  # cpprb draws from numpy's global generator

    def create(self, mode: str, capacity: int = W.CAPACITY) -> None:
        """A buffer of ``capacity`` transitions."""
        env = {
            "obs": {"shape": W.OBS_DIM, "dtype": np.float32},
            "action": {"dtype": np.int64},
            "reward": {"dtype": np.float32},
            "done": {"dtype": np.bool_},
            "next_obs": {"shape": W.OBS_DIM, "dtype": np.float32},
        }
        if mode == "uniform":
            self.buf = self._cpprb.ReplayBuffer(capacity, env)
        else:
            self.buf = self._cpprb.PrioritizedReplayBuffer(capacity, env, alpha=W.ALPHA)

    def add(self, i: int) -> None:
        """32 transitions."""
        self.buf.add(**self._batches[i % len(self._batches)])

    def stored(self) -> dict[str, Any]:
        """Stored transitions."""
        return {"stored": int(self.buf.get_stored_size())}

    def sample(self) -> Any:
        """256 transitions (with indexes and weights when prioritized)."""
        if isinstance(self.buf, self._cpprb.PrioritizedReplayBuffer):
            return self.buf.sample(W.SAMPLE_BATCH, beta=W.BETA)
        return self.buf.sample(W.SAMPLE_BATCH)

    def sample_for_update(self) -> Any:
        """The indexes of a fresh batch of 256."""
        return self.buf.sample(W.SAMPLE_BATCH, beta=W.BETA)["indexes"]

    def update(self, indexes: Any, i: int) -> None:
        """New priorities for 256 indexes."""
        self.buf.update_priorities(indexes, self._prios[i % len(self._prios)])

    def learner_step(self, i: int) -> None:
        """Sample 256, then update exactly their priorities."""
        sample = self.buf.sample(W.SAMPLE_BATCH, beta=W.BETA)
        self.buf.update_priorities(sample["indexes"], self._prios[i % len(self._prios)])


CASES = {case.name: case for case in (ShardReplayCase, TorchRLCase, CpprbCase)}
