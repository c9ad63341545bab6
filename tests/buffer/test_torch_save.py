"""A buffer saves with the agent: ``torch.save(buffer.state_dict())`` and
``torch.load(path)`` with ``weights_only=True`` (torch's default) round-trip it, and the
restored buffer samples exactly what the original samples next."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shardreplay import Field, LinearSchedule, ReplayBuffer, Spec

SPEC = Spec({"obs": Field((3,), np.float32), "action": Field((), np.int64),
             "count": Field((2,), np.uint16), "flag": Field((), np.bool_)})


def _buffer(sampler: str, seed: int) -> ReplayBuffer:
    return ReplayBuffer(SPEC, num_streams=3, stream_capacity=16, window=3, sampler=sampler,
                        beta=LinearSchedule(0.4, 1.0, 50), seed=seed)


def _write(buf: ReplayBuffer, rng: np.random.Generator, steps: int) -> None:
    for _ in range(steps):
        types = rng.choice([0, 1, 1, 1, 2], size=3)
        buf.add({"obs": rng.standard_normal((3, 3), dtype=np.float32),
                 "action": rng.integers(0, 4, 3), "count": rng.integers(0, 60000, (3, 2)),
                 "flag": rng.random(3) < 0.5, "step_type": types,
                 "discount": np.where(types == 2, 0.0, 1.0)}, priorities=rng.uniform(0.1, 3.0, 3))


def _play(buf: ReplayBuffer, rng: np.random.Generator, rounds: int) -> list[dict[str, np.ndarray]]:
    """Samples (and updates, when prioritized) interleaved with writes; what was drawn."""
    out = []
    for _ in range(rounds):
        _write(buf, rng, 4)  # enough new windows for fifo, which hands each out once
        batch = buf.sample(8)
        out.append({"keys": batch.keys.numpy(), "weights": batch.weights.numpy(),
                    "probabilities": batch.probabilities.numpy(), "mask": batch.mask.numpy(),
                    **{f"data.{k}": v.numpy() for k, v in batch.data.items()}})
        if buf.sampler_name == "prioritized":
            buf.update_priorities(batch.keys, rng.uniform(0.0, 4.0, 8))
    return out


@pytest.mark.parametrize("sampler", ["uniform", "prioritized", "fifo"])
def test_torch_save_and_weights_only_load_continue_exactly(tmp_path: Path, sampler: str) -> None:
    a = _buffer(sampler, seed=1)
    rng = np.random.default_rng(0)
    _write(a, rng, 40)  # rings wrap
    _play(a, rng, 5)
    path = tmp_path / "agent.pt"
    torch.save({"replay": a.state_dict(), "step": 123}, path)
    loaded = torch.load(path, weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in loaded["replay"]["arrays"].values())

    b = _buffer(sampler, seed=999)  # another seed: the RNG comes from the file
    b.load_state_dict(loaded["replay"])
    run_a = _play(a, np.random.default_rng(5), 20)
    run_b = _play(b, np.random.default_rng(5), 20)
    for i, (x, y) in enumerate(zip(run_a, run_b, strict=True)):
        assert x.keys() == y.keys()
        for name in x:
            np.testing.assert_array_equal(x[name], y[name], err_msg=f"round {i}: {name}")


def test_load_state_dict_takes_numpy_arrays_too() -> None:
    a = _buffer("prioritized", seed=1)
    _write(a, np.random.default_rng(0), 20)
    state = a.state_dict()
    state = {"meta": state["meta"], "arrays": {k: v.numpy() for k, v in state["arrays"].items()}}
    b = _buffer("prioritized", seed=2)
    b.load_state_dict(state)
    assert a.sample(16).keys.tolist() == b.sample(16).keys.tolist()
