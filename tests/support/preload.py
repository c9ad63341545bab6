"""Imported once by the test ranks' fork server (:func:`tests.support.ranks.rank_context`):
torch, torch.distributed, DDP's compiler hooks and shardreplay's compiled kernels are
loaded there, so each rank forked from it starts without paying for them again. They are
imported as the learners' fork server imports them (the garbage collector paused, then
everything frozen: :mod:`shardreplay.runtime.launch.learner_preload`)."""

from __future__ import annotations

from importlib import import_module

from shardreplay.runtime.launch.learner_preload import import_paused  # torch and the learner, first
from tests.support.warm import warm_kernel_cache

import_paused(("torch.nn.parallel", "shardreplay.checkpoint", "shardreplay.distributed"))
import_module("torch").set_num_threads(1)  # no OpenMP pool exists yet; a forked child must not inherit one
warm_kernel_cache()
