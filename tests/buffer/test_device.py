"""``ReplayBuffer(..., device=)``: where sampled batches land.

Here the CPU paths and the refusal of CUDA where CUDA is missing; on a GPU
(``benchmarks/gpu_check.sh``) the CUDA path: windows gathered into page-locked records
that cross in one copy, equal to the CPU's batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardreplay import ConfigError, Field, ReplayBuffer, Spec
from shardreplay.spec.keys import unpack_keys

SPEC = Spec({"obs": Field((2,), np.float32)})


def _buffer(**kwargs: object) -> ReplayBuffer:
    buf = ReplayBuffer(SPEC, num_streams=2, stream_capacity=8, window=2, sampler="prioritized",
                       seed=0, **kwargs)  # type: ignore[arg-type]
    for t in range(6):
        buf.add({"obs": np.full((2, 2), t, np.float32), "step_type": np.array([min(t, 1)] * 2)})
    return buf


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_cpu_batches_land_on_the_cpu_and_match_the_default(device: object) -> None:
    buf, plain = _buffer(device=device), _buffer()
    assert buf.device == torch.device("cpu")
    batch, expected = buf.sample(16), plain.sample(16)
    tensors = [*batch.data.values(), batch.mask, batch.keys, batch.weights, batch.probabilities]
    assert all(t.device.type == "cpu" for t in tensors)
    np.testing.assert_array_equal(batch.data["obs"].numpy(), expected.data["obs"].numpy())
    # Keys on the buffer's device go back into update_priorities as they are.
    assert buf.update_priorities(batch.keys, torch.full((16,), 2.0, device=buf.device)) == 16


@pytest.mark.parametrize("device", ["meta", "tpu:0", 3.5])
def test_devices_that_hold_no_batch_are_refused(device: object) -> None:
    with pytest.raises(ConfigError, match="device"):
        _buffer(device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is missing")
def test_cuda_without_cuda_is_refused_with_one_line() -> None:
    with pytest.raises(ConfigError, match="CUDA is not available"):
        _buffer(device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batches_land_on_the_gpu() -> None:
    buf, plain = _buffer(device="cuda"), _buffer()
    batch, expected = buf.sample(16), plain.sample(16)
    assert batch.data["obs"].is_cuda and batch.keys.is_cuda and batch.weights.is_cuda
    for name, want in [*expected.data.items(), ("mask", expected.mask), ("weights", expected.weights),
                       ("probabilities", expected.probabilities)]:
        got = batch.data[name] if name in batch.data else getattr(batch, name)
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got.cpu().numpy(), want.numpy(), err_msg=name)
    shard, _tag, place, generation = unpack_keys(batch.keys.cpu().numpy())  # tags differ per buffer
    want_shard, _, want_place, want_generation = unpack_keys(expected.keys.numpy())
    np.testing.assert_array_equal(np.stack([shard, place, generation]),
                                  np.stack([want_shard, want_place, want_generation]))
    # One copy of the records: every field is a view of the same GPU block.
    assert {v.untyped_storage().data_ptr() for v in (*batch.data.values(), batch.mask)} == \
        {batch.keys.untyped_storage().data_ptr()}
    assert buf.update_priorities(batch.keys, torch.full((16,), 2.0, device="cuda")) == 16
