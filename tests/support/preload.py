"""Imported once by the test ranks' fork server (:func:`tests.support.ranks.rank_context`):
torch, torch.distributed, DDP's compiler hooks and shardreplay's compiled kernels are
loaded there, so each rank forked from it starts without paying for them again."""

from __future__ import annotations

import torch
import torch._dynamo  # DDP's constructor imports it (1.7 CPU-seconds)
import torch.distributed
import torch.nn.parallel

import shardreplay.checkpoint
import shardreplay.distributed  # noqa: F401
from tests.support.warm import warm_kernel_cache

torch.set_num_threads(1)  # no OpenMP pool exists yet; a forked child must not inherit one
warm_kernel_cache()
