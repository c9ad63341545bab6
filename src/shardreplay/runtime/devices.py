"""Where learners and actors compute: a learner rank's device and the process group of
its DDP all-reduce (:func:`place`: NCCL when every rank has a GPU to itself, else the
default gloo group); :func:`check_cuda` refuses a GPU that is not here. Which GPU a rank
takes and why: docs/train.md, "GPUs".
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardreplay.errors import ConfigError
from shardreplay.runtime.settings import check_device_name

log = logging.getLogger("shardreplay.learner")


@dataclass(frozen=True)
class Placement:
    """A rank's device and the group of its DDP all-reduce (None: the default group)."""

    device: torch.device
    ddp_group: dist.ProcessGroup | None
    ddp_backend: str


CPU = Placement(torch.device("cpu"), None, "default")  # what a learner without a placement uses


def check_cuda(flag: str, name: str) -> None:
    """Refuse the device ``name`` of ``flag`` unless it is ``cpu``, or ``cuda`` / ``cuda:N``
    naming a GPU this process sees.

    Raises:
        ConfigError: another name, or a GPU that is not here (the message says to use cpu).
    """
    check_device_name(flag, name)
    if name == "cpu":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (int(name.split(":")[1]) if ":" in name else 0) >= count:
        seen = "CUDA is not available here" if count == 0 else \
            f"this process sees {count} GPU(s) (cuda:0 .. cuda:{count - 1})"
        raise ConfigError(f"{flag} {name}: {seen}; use {flag} cpu (the default)")


def resolve_device(name: str, rank: int) -> torch.device:
    """The torch device ``name`` (``cpu``, ``cuda``, ``cuda:N``) means for rank ``rank``;
    for CUDA it also becomes the process's current device.

    Raises:
        ConfigError: see :func:`check_cuda`.
    """
    check_cuda("--device", name)
    if name == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    index = int(name.split(":")[1]) if ":" in name else int(os.environ.get("LOCAL_RANK", rank)) % count
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _gpu_id(device: torch.device) -> torch.Tensor:
    """This rank's GPU as one number, equal on two ranks iff they share it: a hash of the
    GPU's UUID (or, where torch gives none, of the host name and device index)."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    name = str(uuid) if uuid is not None else f"{os.uname().nodename}/{device.index}"
    return torch.tensor([int.from_bytes(hashlib.blake2b(name.encode(), digest_size=7).digest(), "little")])


def place(name: str, rank: int, world: int) -> Placement:
    """This rank's :class:`Placement` (a collective when ``world > 1`` and CUDA: every rank
    calls it at the same point, and all create the NCCL group or none does).

    Raises:
        ConfigError: see :func:`resolve_device`.
    """
    device = resolve_device(name, rank)
    if world == 1 or device.type == "cpu":
        return Placement(device, None, str(dist.get_backend()) if world > 1 else "none")
    # Every rank must take the same decision: gather who sits on which GPU (gloo, CPU).
    mine = _gpu_id(device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    own_gpu = len({int(t) for t in every}) == world
    if own_gpu and dist.is_nccl_available():
        return Placement(device, dist.new_group(backend="nccl"), "nccl")
    if rank == 0:
        log.info("learner ranks share a GPU (NCCL refuses that): DDP all-reduces over gloo")
    return Placement(device, None, str(dist.get_backend()))


def wrap(net: nn.Module, placement: Placement, world: int) -> nn.Module:
    """``net`` moved to the rank's device, in DDP over the placement's group when ``world > 1``."""
    net = net.to(placement.device)
    if world == 1:
        return net
    ids = [placement.device] if placement.device.type == "cuda" else None
    return DistributedDataParallel(net, device_ids=ids, process_group=placement.ddp_group)
