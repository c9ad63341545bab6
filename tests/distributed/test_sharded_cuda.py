"""Sharded sampling with batches on a GPU, and over NCCL (tests marked ``cuda``: skipped
without a GPU; ``benchmarks/gpu_check.sh`` runs them on a GPU machine).

Two gloo ranks sharing one GPU draw the same batches on ``device="cuda"`` as on the CPU
(strict, local, prefetch 2 and pipelined, with priority updates given as CUDA tensors in
between, except when pipelined: there timing decides which draw an update reaches
first). The GPU changes where a batch lands, never what is drawn; in exact mode the
records cross in one copy (every field a view of them on the GPU). Over NCCL, a group of
every GPU there is (one rank on a one-GPU machine: NCCL refuses two ranks on one device)
samples and updates as a gloo group of the same size does.
"""

from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist

import shardreplay as sr
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.spec.keys import unpack_keys
from tests.support import free_port, run_ranks

pytestmark = [pytest.mark.cuda, pytest.mark.distributed]

SPEC = sr.Spec({"obs": sr.Field((3,), np.float32), "act": sr.Field((), np.int64)})
STREAMS, CAPACITY, WINDOW, BATCH, CALLS = 3, 64, 3, 32, 6


def _filled(rank: int, device: str, **kwargs: object) -> ShardedReplayBuffer:
    local = sr.ReplayBuffer(SPEC, num_streams=STREAMS, stream_capacity=CAPACITY, window=WINDOW,
                            sampler="prioritized", alpha=0.7, beta=0.5, seed=100 + rank)
    buf = ShardedReplayBuffer(local, seed=7 + rank, timeout_s=60, device=device, **kwargs)  # type: ignore[arg-type]
    for t in range(40 + 9 * rank):  # unequal shards
        types = np.array([0 if t % 11 == 0 else (2 if t % 11 == 10 else 1)] * STREAMS)
        buf.add({"obs": np.full((STREAMS, 3), 1000 * rank + t, np.float32),
                 "act": np.arange(STREAMS) + 10 * t, "step_type": types})
    return buf


def _draws(rank: int, device: str, **kwargs: object) -> list[dict[str, np.ndarray]]:
    buf = _filled(rank, device, **kwargs)
    out = []
    for call in range(CALLS):
        batch = buf.sample(BATCH)
        assert batch.data["obs"].device.type == torch.device(device).type
        assert batch.keys.device.type == torch.device(device).type
        if device == "cuda" and kwargs.get("mode", "exact") == "exact":
            # The exchanged records crossed in one copy: every field is a view of them.
            block = batch.keys.untyped_storage().data_ptr()
            assert {v.untyped_storage().data_ptr() for v in (*batch.data.values(), batch.mask)} == {block}
        shard, _tag, place, generation = unpack_keys(batch.keys.cpu().numpy())  # tags differ per buffer
        out.append({"obs": batch.data["obs"].cpu().numpy(), "key_place": np.stack([shard, place, generation]),
                    "weights": batch.weights.cpu().numpy(), "mask": batch.mask.cpu().numpy()})
        # New priorities made on the batch's device (as a learner's TD errors are). Not
        # with pipeline: which draw an update reaches first depends on the thread's timing.
        if not kwargs.get("pipeline"):
            prios = (batch.weights.double() + 0.1 * (call + 1)).to(batch.keys.device)
            buf.update_priorities(batch.keys, prios)
    buf.close()
    return out


def _cpu_and_cuda(rank: int, world: int, kwargs: dict) -> tuple[list, list]:
    torch.cuda.set_device(0)
    return _draws(rank, "cpu", **kwargs), _draws(rank, "cuda", **kwargs)


@pytest.mark.parametrize("kwargs", [{}, {"pipeline": True}, {"mode": "local"}, {"prefetch": 2}],
                         ids=["strict", "pipelined", "local", "prefetch2"])
def test_batches_on_the_gpu_are_the_batches_drawn_on_the_cpu(kwargs: dict) -> None:
    for cpu, cuda in run_ranks(_cpu_and_cuda, 2, kwargs):
        for a, b in zip(cpu, cuda, strict=True):
            for name in a:
                np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def _nccl_world(rank: int, world: int, port: int, backend: str) -> list[dict[str, np.ndarray]]:
    torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        return _draws(rank, "cuda")
    finally:
        dist.destroy_process_group()


def _relaunch(rank: int, world: int, port: int, backend: str) -> list:
    dist.destroy_process_group()  # leave run_ranks' gloo group: this rank joins a fresh one
    return _nccl_world(rank, world, port, backend)


def test_nccl_samples_and_updates_as_gloo_does_over_every_gpu() -> None:
    world = min(2, torch.cuda.device_count())
    over_nccl = run_ranks(_relaunch, world, free_port(), "nccl")
    over_gloo = run_ranks(_relaunch, world, free_port(), "gloo")
    for a_rank, b_rank in zip(over_nccl, over_gloo, strict=True):
        for a, b in zip(a_rank, b_rank, strict=True):
            for name in a:
                np.testing.assert_array_equal(a[name], b[name], err_msg=name)
