"""Where learners and actors compute (``--device``, ``--actor-device``): the names refused
everywhere, and on a GPU machine (tests marked ``cuda``) the placement, DDP's group and
one training step whose parameters stay identical across two ranks sharing the GPU."""

from __future__ import annotations

import pytest
import torch

from shardreplay.errors import ConfigError
from shardreplay.runtime.devices import check_cuda, place, resolve_device, wrap
from shardreplay.runtime.settings import TrainSettings
from tests.support import run_ranks


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "CPU", "cuda0", ""])
def test_device_names_other_than_cpu_cuda_cuda_n_are_refused_by_the_settings(name: str) -> None:
    with pytest.raises(ConfigError, match="device must be cpu, cuda or cuda:N"):
        TrainSettings.from_dict({"device": name})
    with pytest.raises(ConfigError, match="actor_device must be cpu, cuda or cuda:N"):
        TrainSettings.from_dict({"actor_device": name})


def test_cpu_is_the_default_and_cuda_names_are_accepted_by_the_settings() -> None:
    s = TrainSettings.from_dict({})
    assert (s.learners.device, s.actors.device) == ("cpu", "cpu")
    s = TrainSettings.from_dict({"device": "cuda:1", "actor_device": "cuda"})
    assert (s.learners.device, s.actors.device) == ("cuda:1", "cuda")
    assert TrainSettings.from_dict(s.to_dict()) == s  # kept in config.json and checkpoints


def test_cpu_places_on_the_cpu_and_wraps_nothing_on_one_rank() -> None:
    assert resolve_device("cpu", 3) == torch.device("cpu")
    check_cuda("--actor-device", "cpu")
    net = torch.nn.Linear(2, 2)
    assert wrap(net, place("cpu", 0, 1), 1) is net


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is missing")
@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_one_clear_error_for_learners_and_actors(name: str) -> None:
    with pytest.raises(ConfigError, match="CUDA is not available here"):
        resolve_device(name, 0)
    with pytest.raises(ConfigError, match=f"--actor-device {name}: CUDA is not available here; use --actor"):
        check_cuda("--actor-device", name)


@pytest.mark.cuda
def test_cuda_takes_the_local_rank_modulo_the_gpus_and_becomes_current() -> None:
    count = torch.cuda.device_count()
    assert resolve_device("cuda", count + 1) == torch.device("cuda", 1 % count)
    assert torch.cuda.current_device() == 1 % count
    with pytest.raises(ConfigError, match=r"this process sees \d+ GPU\(s\)"):
        resolve_device(f"cuda:{count}", 0)


def _two_ranks_on_one_gpu(rank: int, world: int) -> tuple[str, list[float], str]:
    torch.manual_seed(0)
    placement = place("cuda:0", rank, world)  # both ranks on the same GPU
    net = wrap(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)),
               placement, world)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(3):  # each rank its own data: only the all-reduce keeps them equal
        x = torch.full((5, 4), float(rank + step), device=placement.device)
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
    params = torch.cat([p.detach().flatten() for p in net.parameters()])
    return placement.ddp_backend, params.cpu().tolist(), str(params.device)


@pytest.mark.cuda
@pytest.mark.distributed
def test_two_ranks_sharing_a_gpu_all_reduce_over_gloo_and_stay_identical() -> None:
    results = run_ranks(_two_ranks_on_one_gpu, 2)
    # NCCL refuses two ranks on one device ("Duplicate GPU detected"): gloo takes DDP.
    assert [r[0] for r in results] == ["gloo", "gloo"]
    assert results[0][1] == results[1][1]
    assert all(r[2].startswith("cuda") for r in results)
