"""Learner benchmark: DDP over K gloo ranks (default 2) training a DQN network from sharded replay.

Each rank holds a prioritized shard and trains Double DQN (``shardreplay.runtime.algos.dqn``,
n-step windows, Adam, DDP all-reducing the gradients on the default group) on batches of
256, with one of four ways of sampling per learner step:

* ``own``: each rank samples only its own shard (a plain ``ReplayBuffer``, no collective);
* ``local``: ``ShardedReplayBuffer(mode="local")``: each rank draws from its own shard, the
  weights carry the shard factor (one small all_to_all every 16th step, none in the update);
* ``strict``: exact global sampling, ``ShardedReplayBuffer(prefetch=1)``: the exchange runs
  in the learner's thread, every update lands before the next draw;
* ``pipelined``: exact global sampling, ``ShardedReplayBuffer(prefetch=1, pipeline=True)``:
  the exchange for the next step runs on a background thread while this one trains.

Three networks: ``mlp`` (a 3-layer MLP of 512 units on a 64-float observation), ``conv``
(the Nature-DQN conv net on 84x84x4 uint8 frames) and ``minatar`` (the MinAtar paper's net on
4x10x10 0/1 frames; with ``--batch 32`` the issue-42 seed scenario). The samplings of a network take
turns block by block (the order rotating), so a load change on the machine hits all of
them; each figure is the median of its blocks' learner steps/s (the ranks move in lock-step,
the slower rank's time counts). One JSON line is printed with the figures and the ratios
``pipelined/own`` (targets: conv and minatar >= 0.95, mlp >= 0.85), ``strict/own`` and
``local/own``, each sampling's CPU time per step (``cpu_ms_per_step``: the process's, its
gloo and exchange threads included, the mean over ranks), and for each
sampling the learner thread's time per step inside ``sample`` and ``update_priorities``
(``replay_ms_per_step``, the slower rank's; the median of the blocks): the cost pipelining
hides, less noisy than the rates on a loaded machine; ``..._min``: the quickest block's, the
figure least disturbed by other load.

``--link-delay-ms D`` (old name ``--netem-delay-ms``) runs the two ranks in two network
namespaces joined by a link with D ms of delay each way (:func:`netns.delayed_link`, root
only): a veth pair with ``tc netem`` where the kernel has netem, else a TUN relay process; the
line says which (``delay_kind``) and the link's measured TCP round trip (``link_rtt_ms``,
:mod:`linkprobe`). ``--link-kind tun-relay`` takes the relay even where netem exists (with
``--link-delay-ms 0``: what the relay alone costs). Records then go through the link, not
``/dev/shm`` (each namespace has a host name of its own: ``netns.enter``).

``--ranks K`` runs K ranks. With ``--link-delay-ms`` and K other than 2 (or ``--hub``) the
ranks run in K namespaces on one routed network (:func:`netns.hosts`), each host's link to
the hub delayed by D/2 each way, so that any two ranks are again D apart each way (two
relays on the way, where it is the relay: ``link_rtt_ms`` says what the round trip is).

``--hosts H`` (with ``--hub``) makes H namespaces instead of K and puts rank ``r`` on host
``r * H // K``: ranks on one host exchange through its ``/dev/shm`` and their host's leader
with the other hosts' (the hierarchical exchange), as on a real machine.

``--gpu-step-ms X`` measures the sampling alone against a GPU learner step: instead of
training, each step waits X ms (the CPU is free meanwhile, as while a GPU computes) and
returns random priorities; no network is trained, no DDP. So K ranks on fewer cores measure
the link and the exchange, not the contention of K trainings (``--nets mlp`` gives the records'
layout).

``--device cuda`` puts the networks, optimizers and batches on the GPU (batches pinned
and copied without blocking; the replay exchange stays on gloo, on the CPU). The two
ranks then share GPU 0 when there is one GPU (NCCL refuses that, so DDP all-reduces over
gloo: ``ddp_backend`` in the line); ``--batch`` sets the batch (512 on a GPU: issue 21).

Usage::

    python benchmarks/train/bench_learner.py                  # full run (minutes on 2 cores)
    python benchmarks/train/bench_learner.py --quick          # smoke run
    python benchmarks/train/bench_learner.py --link-delay-ms 0.25
    python benchmarks/train/bench_learner.py --device cuda --batch 512 --nets conv
    python benchmarks/train/bench_learner.py --ranks 4 --link-delay-ms 0.25 --gpu-step-ms 5 --nets mlp
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import queue
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import common

common.use("net")  # the network namespaces and the link probe

import linkprobe  # noqa: E402
import netns  # noqa: E402

WORLD, BATCH, N_STEP, ACTIONS, STREAMS = 2, 256, 3, 18, 8
SAMPLINGS = ("own", "strict", "pipelined", "local")
TARGETS = {"conv": 0.95, "mlp": 0.85, "minatar": 0.95}
OBS = {"mlp": ((64,), np.float32), "conv": ((84, 84, 4), np.uint8), "minatar": ((4, 10, 10), np.uint8)}
# Many short blocks: the samplings alternate often, so load drift hits them alike.
FULL = {"blocks": 10, "steps": {"mlp": 20, "conv": 2, "minatar": 20},
        "warmup": {"mlp": 3, "conv": 1, "minatar": 3},
        "capacity": {"mlp": 100_000, "conv": 4_000, "minatar": 50_000}}
QUICK = {"blocks": 1, "steps": {"mlp": 3, "conv": 1, "minatar": 3},
         "warmup": {"mlp": 1, "conv": 1, "minatar": 1},
         "capacity": {"mlp": 2_000, "conv": 400, "minatar": 2_000}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = common.parser(__doc__, quick="smoke run")
    p.add_argument("--nets", default="mlp,conv", help="comma-separated networks: mlp, conv, minatar "
                                                        "(default mlp,conv)")
    p.add_argument("--samplings", default=",".join(SAMPLINGS),
                   help=f"comma-separated samplings, own first (default {','.join(SAMPLINGS)})")
    p.add_argument("--blocks", type=int, help="timing blocks per figure (default 10)")
    p.add_argument("--ranks", type=int, default=WORLD, help=f"gloo ranks (default {WORLD})")
    p.add_argument("--threads", type=int, help="torch threads per rank (default: cores / ranks, at least 1)")
    p.add_argument("--link-delay-ms", "--netem-delay-ms", type=float, default=None, dest="link_delay_ms",
                   help="run the ranks in two network namespaces joined by a link with this one-way "
                        "delay: netem, else a TUN relay (root)")
    p.add_argument("--link-kind", choices=netns.KINDS, default="auto",
                   help="how --link-delay-ms is made: auto (netem, else the TUN relay; default), "
                        "netem or tun-relay")
    p.add_argument("--hub", action="store_true",
                   help="with --link-delay-ms: namespaces on a routed network (netns.hosts) also for 2 ranks")
    p.add_argument("--hosts", type=int, default=None,
                   help="with --hub: this many hosts (namespaces), the ranks spread evenly over them "
                        "(default: one per rank)")
    p.add_argument("--gpu-step-ms", type=float, default=None,
                   help="instead of training, each step waits this long (an emulated GPU step) and "
                        "returns random priorities")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="limit for the whole run")
    p.add_argument("--device", default="cpu", help="cpu or cuda: where networks and batches live")
    p.add_argument("--batch", type=int, default=BATCH, help=f"windows per rank per step (default {BATCH})")
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    args.blocks = args.blocks or plan["blocks"]
    args.steps, args.warmup, args.capacity = plan["steps"], plan["warmup"], plan["capacity"]
    args.nets = [n for n in args.nets.split(",") if n]
    args.samplings = tuple(s for s in args.samplings.split(",") if s)
    if not args.samplings or args.samplings[0] != "own" or not set(args.samplings) <= set(SAMPLINGS):
        p.error(f"--samplings must start with own and name some of {SAMPLINGS}")
    if args.ranks < 2:
        p.error("--ranks must be at least 2")
    args.threads = args.threads or max(1, (os.cpu_count() or 2) // args.ranks)
    if args.hosts is not None and not (args.hub and 2 <= args.hosts <= args.ranks):
        p.error("--hosts needs --hub and 2 <= H <= --ranks")
    if not set(args.nets) <= set(TARGETS):
        p.error(f"--nets must name some of {sorted(TARGETS)}")
    return args


# -- the workload (runs in the ranks) -------------------------------------------------------------
def make_net(name: str) -> Any:
    """The Q-network: the MLP of ``shardreplay train`` widened, the Nature-DQN conv net, or
    the MinAtar net."""
    import torch
    from torch import nn

    from shardreplay.runtime.algos.networks import MinAtarQNetwork, QNetwork

    if name == "mlp":
        return QNetwork(64, ACTIONS, (512, 512, 512))
    if name == "minatar":
        return MinAtarQNetwork(OBS[name][0], ACTIONS)

    class NatureDqn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Conv2d(4, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
                                     nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten(),
                                     nn.Linear(3136, 512), nn.ReLU(), nn.Linear(512, ACTIONS))

        def forward(self, obs: torch.Tensor) -> torch.Tensor:  # [B, 84, 84, 4] frames as floats
            return self.net(obs.permute(0, 3, 1, 2) / 255.0)

    return NatureDqn()


def make_shard(name: str, capacity: int, seed: int, device: str = "cpu") -> Any:
    """A prioritized shard of ``capacity`` steps of random observations and episodes."""
    import shardreplay as sr

    obs = sr.Field(*OBS[name])
    spec = sr.Spec({"obs": obs, "action": sr.Field((), np.int64), "reward": sr.Field((), np.float32)})
    per_stream = capacity // STREAMS
    buf = sr.ReplayBuffer(spec, num_streams=STREAMS, stream_capacity=per_stream, window=N_STEP + 1,
                          sampler="prioritized", alpha=0.6, beta=0.4, seed=seed, device=device)
    rng = np.random.default_rng(seed)
    chunk = min(per_stream, 250)
    for start in range(0, per_stream, chunk):
        t = np.arange(start, start + chunk)
        types = np.where(t % 100 == 0, 0, np.where(t % 100 == 99, 2, 1)).astype(np.uint8)
        shape = (STREAMS, chunk, *obs.shape)
        frames = (rng.standard_normal(shape, dtype=np.float32) if name == "mlp"
                  else rng.integers(0, 2 if name == "minatar" else 256, shape, dtype=np.uint8))
        buf.extend({"obs": frames, "action": rng.integers(0, ACTIONS, (STREAMS, chunk)),
                    "reward": rng.standard_normal((STREAMS, chunk), dtype=np.float32),
                    "step_type": np.broadcast_to(types, (STREAMS, chunk))})
    return buf


def _net_results(name: str, rank: int, args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    from shardreplay.distributed import ShardedReplayBuffer
    from shardreplay.runtime.algos.dqn_torch import DoubleDqn, DqnSettings
    from shardreplay.runtime.devices import place, wrap

    torch.manual_seed(0)
    world = args.ranks
    placement = place(args.device, rank, world)
    emulated = args.gpu_step_ms is not None
    agent = None if emulated else DoubleDqn(wrap(make_net(name), placement, world), DqnSettings(lr=1e-4))
    rng = np.random.default_rng(rank)
    local = make_shard(name, args.capacity[name], seed=100 + rank, device=args.device)
    strict = ShardedReplayBuffer(local, timeout_s=300, prefetch=1, device=args.device)
    piped = ShardedReplayBuffer(local, timeout_s=300, prefetch=1, pipeline=True, device=args.device)
    local_mode = ShardedReplayBuffer(local, timeout_s=300, prefetch=1, mode="local", device=args.device)
    sync = torch.cuda.synchronize if placement.device.type == "cuda" else (lambda: None)
    buffers = {"own": local, "strict": strict, "pipelined": piped, "local": local_mode}
    samplings = args.samplings

    replay_s = [0.0]  # the learner thread's time inside sample() and update_priorities()

    def step(buf: Any) -> None:
        t0 = time.perf_counter()
        batch = buf.sample(args.batch)
        t1 = time.perf_counter()
        if agent is None:  # the GPU's step: the CPU waits, free for the exchange's thread
            time.sleep(args.gpu_step_ms / 1e3)
            prios: Any = rng.uniform(0.1, 2.0, len(batch.keys)).astype(np.float32)
        else:
            prios, _loss = agent.learn(batch)
        t2 = time.perf_counter()
        buf.update_priorities(batch.keys, prios)
        replay_s[0] += t1 - t0 + time.perf_counter() - t2

    rates: dict[str, list[float]] = {s: [] for s in samplings}
    replay_ms: dict[str, list[float]] = {s: [] for s in samplings}
    cpu_ms: dict[str, list[float]] = {s: [] for s in samplings}
    for block in range(args.blocks + 1):  # block 0 warms every path up, untimed
        for i in range(len(samplings)):
            sampling = samplings[(block + i) % len(samplings)]
            buf = buffers[sampling]
            for _ in range(args.warmup[name]):
                step(buf)
            dist.barrier()
            start, cpu, replay_s[0] = time.perf_counter(), time.process_time(), 0.0
            for _ in range(args.steps[name]):
                step(buf)
            sync()  # the GPU's queued work belongs to this block
            wall = time.perf_counter() - start
            piped.settle()  # its thread idle while the others are timed; its CPU is this block's
            cpu = time.process_time() - cpu
            times = torch.tensor([wall, replay_s[0]], dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            cpu_sum = torch.tensor([cpu], dtype=torch.float64)
            dist.all_reduce(cpu_sum)
            if block:
                rates[sampling].append(args.steps[name] / float(times[0]))
                replay_ms[sampling].append(1e3 * float(times[1]) / args.steps[name])
                cpu_ms[sampling].append(1e3 * float(cpu_sum[0]) / world / args.steps[name])
    piped.close()
    return {"rates": {s: common.median(r) for s, r in rates.items()},
            "replay_ms": {s: common.median(r) for s, r in replay_ms.items()},
            "replay_ms_min": {s: min(r) for s, r in replay_ms.items()},
            "cpu_ms": {s: common.median(r) for s, r in cpu_ms.items()},
            "ddp_backend": placement.ddp_backend, "gpu": _gpu_name(placement.device)}


def _gpu_name(device: Any) -> str | None:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def _rank(rank: int, args: argparse.Namespace, addr: str, port: int, ifname: str, namespace: str,
          out: Any) -> None:
    try:
        if namespace:
            netns.enter(namespace)
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
        import torch
        import torch.distributed as dist

        torch.set_num_threads(args.threads)
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=args.ranks,
                                timeout=datetime.timedelta(seconds=300))
        results = {name: _net_results(name, rank, args) for name in args.nets}
        dist.destroy_process_group()
        out.put((rank, "ok", results))
    except BaseException as exc:
        import traceback

        out.put((rank, "error", f"{exc!r}\n{traceback.format_exc()}"))


def run_ranks(args: argparse.Namespace, link: netns.Link | netns.Hosts | None) -> dict:
    """Start the ranks (in the link's or hosts' namespaces when given), return rank 0's figures."""
    world = args.ranks
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    if link is None:
        port = common.free_port()
        places = [("127.0.0.1", "lo", "")] * world
    else:
        port = 29_500 + os.getpid() % 1000  # a fresh namespace has every port free
        if isinstance(link, netns.Link):
            places = [(link.addresses[0], link.ifnames[r], link.namespaces[r]) for r in range(world)]
        else:  # rank r on host r * H // K
            count = len(link.namespaces)
            places = [(link.addresses[0], link.ifname, link.namespaces[r * count // world])
                      for r in range(world)]
    from shardreplay.runtime.actor.processes import stop_processes  # lazily: ranks re-import this module

    procs = [ctx.Process(target=_rank, args=(r, args, places[r][0], port, places[r][1], places[r][2], out))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + args.timeout_s
        while len(results) < world:
            rank, status, value = out.get(timeout=max(1.0, deadline - time.monotonic()))
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed: {value}")
            results[rank] = value
    except queue.Empty as exc:
        raise RuntimeError(f"timed out after {args.timeout_s} s") from exc
    finally:
        stop_processes(procs, timeout_s=5.0, grace_s=30 if len(results) == world else 1)
    return results[0]


def _open_link(args: argparse.Namespace, stack: ExitStack) -> netns.Link | netns.Hosts:
    """The namespaces the ranks run in: a pair (2 ranks) or hosts on a hub (``--hub``, K != 2)."""
    why = netns.unavailable()
    if why:
        raise SystemExit(f"--link-delay-ms needs network namespaces: {why}")
    if args.ranks == 2 and not args.hub:
        return stack.enter_context(netns.delayed_link(args.link_delay_ms, kind=args.link_kind))
    # Half the delay on each host's link: two ranks are D apart each way, as on the pair.
    count = args.hosts or args.ranks
    hosts = netns.hosts(count, args.link_delay_ms / 2, delayed=tuple(range(count)), kind=args.link_kind)
    return stack.enter_context(hosts)


def _probe_link(link: netns.Link | netns.Hosts) -> netns.Link:
    """The link between the first two ranks, as :mod:`linkprobe` takes it."""
    if isinstance(link, netns.Link):
        return link
    (a, b), (addr_a, addr_b) = link.namespaces[:2], link.addresses[:2]
    return netns.Link((a, b), (addr_a, addr_b), (link.ifname, link.ifname), 2 * link.delay_ms,
                      link.netem_error, link.delay_kind)


def _relay_cpu_s(link: netns.Link | netns.Hosts | None) -> float | None:
    """CPU seconds the link's relays have used so far (None: no relay)."""
    pids = () if link is None else (link.relay_pid,) if isinstance(link, netns.Link) else link.relay_pids
    pids = tuple(p for p in pids if p)
    return sum(netns.cpu_s(p) for p in pids) if pids else None


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print (and optionally write) one JSON line."""
    args = parse_args(argv)
    with ExitStack() as stack:
        link = None if args.link_delay_ms is None else _open_link(args, stack)
        probed = {} if link is None else linkprobe.rtt_ms(_probe_link(link))
        rtt = {k: round(v, 3) for k, v in probed.items() if k != "count"} or None
        relay_cpu_s = _relay_cpu_s(link)
        with common.timed() as ran:
            figures = run_ranks(args, link)
        wall_s = ran.wall_s
        if relay_cpu_s is not None:  # the relays' share of the cores while the ranks ran
            relay_cpu_s = (_relay_cpu_s(link) or 0.0) - relay_cpu_s
    nets = {}
    for name, fig in figures.items():
        rates = fig["rates"]
        nets[name] = {**{f"{s}_steps_per_s": round(r, 3) for s, r in rates.items()},
                      **{f"{s}_replay_ms_per_step": round(r, 3) for s, r in fig["replay_ms"].items()},
                      **{f"{s}_replay_ms_per_step_min": round(r, 3) for s, r in fig["replay_ms_min"].items()},
                      **{f"{s}_cpu_ms_per_step": round(r, 3) for s, r in fig["cpu_ms"].items()},
                      **{f"{s}_over_own": round(r / rates["own"], 3) for s, r in rates.items() if s != "own"},
                      "target_pipelined_over_own": TARGETS[name]}
        if "pipelined" in rates:
            nets[name]["met"] = rates["pipelined"] / rates["own"] >= TARGETS[name]
    first = next(iter(figures.values()))
    line = {"bench": "learner", "ranks": args.ranks, "backend": "gloo", "device": args.device,
            "batch": args.batch,
            "ddp_backend": first["ddp_backend"], "gpu": first["gpu"],
            "n_step": N_STEP, "threads_per_rank": args.threads, "blocks": args.blocks,
            "steps_per_block": {n: args.steps[n] for n in args.nets}, "quick": args.quick,
            "link": "loopback" if link is None else ("tun" if link.delay_kind == "tun-relay" else "veth"),
            "topology": None if link is None else "pair" if isinstance(link, netns.Link) else "hub",
            "hosts": None if link is None else len(link.namespaces),
            "gpu_step_ms": args.gpu_step_ms,
            "link_delay_ms_asked": args.link_delay_ms,
            "link_delay_ms_applied": None if link is None else _probe_link(link).delay_ms,
            "delay_kind": None if link is None else link.delay_kind,
            "link_rtt_ms": rtt, "wall_s": round(wall_s, 1),
            "relay_cpu_s": None if relay_cpu_s is None else round(relay_cpu_s, 1),
            "netem_error": None if link is None else (link.netem_error or None),
            "cores": common.cpus(), "loadavg": common.loadavg(),
            "nets": nets}
    common.emit_line(line, args.out)
    return line


if __name__ == "__main__":
    main()
