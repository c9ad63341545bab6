"""Collectives over a torch.distributed group, with timeouts and our own errors.

This is the only module that imports ``torch.distributed``. Every operation is issued
asynchronously and waited on with a timeout, so a peer that never joins gives a
:class:`CollectiveTimeout` naming the operation and this rank instead of a hang. A peer
whose connection breaks (its process died: gloo reports "Connection reset by peer" at
once) gives :class:`PeerLost`, which says so instead of blaming the timeout.
"""

from __future__ import annotations

import copy
import datetime
import math
import re
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shardreplay.distributed.hierarchy import Hierarchy, host_groups
from shardreplay.distributed.same_host import SameHost, nonce
from shardreplay.errors import CollectiveTimeout, ConfigError, PeerLost, ShardReplayError

# What a wait runs inside: a fresh context per collective (e.g. a lock let go).
Released = Callable[[], AbstractContextManager[Any]]

# How gloo (and NCCL) word a broken connection to a peer, as opposed to a timeout.
_PEER_GONE = ("connection reset", "connection closed", "broken pipe", "connection refused",
              "socket closed", "end of file")


def peer_lost(exc: BaseException) -> bool:
    """True when ``exc`` is the backend saying the connection to a peer rank broke."""
    return isinstance(exc, RuntimeError) and not isinstance(exc, ShardReplayError) \
        and any(word in str(exc).lower() for word in _PEER_GONE)


# gloo names the peer of a broken connection "[address]:port".
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")


def lost_node(text: str) -> str:
    """The learner node a backend error's ``text`` names: ``"host (address)"`` (the name
    from the resolver: /etc/hosts, DNS), the address alone when it has no name, ``""`` when
    the text names none."""
    found = _PEER_ADDRESS.search(text)
    if found is None:
        return ""
    address = found.group(1)
    try:
        name = socket.gethostbyaddr(address)[0]
    except OSError:  # no name known: the address is what the operator can look up
        return address
    return f"{name} ({address})" if name != address else address


def lost_peer_error(exc: BaseException, what: str) -> PeerLost:
    """Our :class:`PeerLost` for a backend error ``exc`` that :func:`peer_lost` recognised
    (e.g. from DDP's all-reduce in ``backward``); ``what`` says what failed and where. Its
    one line starts with the node that was lost (host name and address, when gloo names it)."""
    # The backend's text starts with a source path and ends in generic advice: keep
    # only what happened ("Connection reset by peer [127.0.0.1]:40339").
    detail = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).split(". ")[0])
    node = lost_node(detail)
    return PeerLost(f"lost learner node {node or '(not named by the backend)'}: {what}: a peer rank "
                    f"stopped answering (its process died?); the connection to it was lost ({detail}). "
                    "Continue with --auto-resume from the newest complete checkpoint, on the nodes "
                    "left or once the node is back")


class Collectives:
    """The few collectives sharded replay needs, bound to one process group.

    Args:
        group: a process group (None: the default group, which must be initialised).
        timeout_s: how long one collective may wait for the other ranks.

    Raises:
        ConfigError: torch.distributed is not initialised, or timeout_s <= 0.
    """

    def __init__(self, group: Any = None, timeout_s: float = 60.0) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised: call "
                              "torch.distributed.init_process_group() first (or run under torchrun)")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
        self.group = group
        self.timeout_s = float(timeout_s)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if self.backend == "nccl" else torch.device("cpu"))
        # Collectives issued on this group so far (each counted once, when waited on):
        # the figure tests/distributed/test_sharded_collectives.py checks per call.
        self.issued = 0
        self.same_host: SameHost | None = None  # where shared_copy's collectives go
        self.hierarchy: Hierarchy | None = None  # or there, on several hosts

    def private_copy(self) -> Collectives:
        """The same collectives over a new process group of the same ranks and backend
        (collective: every rank of the default group calls it, in the same order as
        any other ``new_group``). Its collectives never pair up with this group's, so
        another thread may issue them concurrently.

        Raises:
            CollectiveTimeout: a rank did not join the new group in time.
        """
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else None
        return Collectives(self._new_group(ranks), self.timeout_s)

    def _new_group(self, ranks: list[int] | None, apart: bool = False) -> Any:
        """A new group of ``ranks`` (``apart``: only they build it)."""
        try:
            return dist.new_group(ranks, timeout=datetime.timedelta(seconds=self.timeout_s),
                                  backend=self.backend, use_local_synchronization=apart)
        except RuntimeError as exc:
            raise self._failure("ShardedReplayBuffer(new_group)", exc) from exc

    def shared_copy(self, host: SameHost, nonces: Any, keys: Any = None) -> Collectives:
        """The same collectives through shared memory (collective: every rank of this group,
        each with its ``host`` made before they agreed on ``nonces`` and host ``keys``, None:
        all on this host). On several hosts a host's ranks exchange through regions of their
        own, and one leader per host over a gloo group of the leaders (:mod:`hierarchy`;
        when this group spans the default group, every rank builds it at the same point as
        any other ``new_group``). Like :meth:`private_copy`'s, they never pair up with this
        group's.

        Raises:
            CollectiveTimeout: a rank did not map the regions (or build the group) in time.
        """
        shared, hosts = copy.copy(self), host_groups(keys if keys is not None else [0] * self.world_size)
        if len(hosts) == 1:
            shared.same_host = host
            host.join(nonces)
        else:
            host.close()  # made for all the ranks: a host's ranks make their own
            mine = next(h for h in hosts if self.rank in h)
            host = SameHost(nonce(), mine.index(self.rank), len(mine))
            host.join(self.all_gather(np.array([host.nonce]), "ShardedReplayBuffer(host regions)")
                      .reshape(-1)[mine])
            ranks = dist.get_process_group_ranks(self.group if self.group is not None else dist.group.WORLD)
            apart, lead = self.world_size < dist.get_world_size(), self.rank == mine[0]
            group = self._new_group([ranks[h[0]] for h in hosts], apart) if lead or not apart else None
            shared.hierarchy = Hierarchy(host, hosts, self.rank, _Leaders(group) if lead else None)
        shared.all_gather(np.zeros(1), "ShardedReplayBuffer(shared-memory collectives)")
        host.forget_name()  # every rank has mapped every region
        shared.issued = 0  # as a new group's (new_group is not counted either)
        return shared

    def destroy(self) -> None:
        """Destroy this group (only for a group made by :meth:`private_copy` or
        :meth:`shared_copy`)."""
        if self.hierarchy is not None:
            self.hierarchy.close()
        elif self.same_host is not None:
            self.same_host.close()
        elif dist.is_initialized() and self.group is not None:
            dist.destroy_process_group(self.group)

    def _wait(self, work: Any, op: str, released: Released | None) -> None:
        """Wait for ``work`` inside ``released()`` (see :meth:`all_gather`)."""
        self.issued += 1
        try:
            with released() if released is not None else nullcontext():
                ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise self._failure(op, exc) from exc
        if ok is False:
            raise self._failure(op, None)

    def _failure(self, op: str, exc: BaseException | None) -> ShardReplayError:
        """Our error for a collective that raised ``exc`` (None: it timed out)."""
        where = f"on rank {self.rank} of {self.world_size}"
        text = "" if exc is None else str(exc)
        if exc is not None and peer_lost(exc):
            return lost_peer_error(exc, f"{op} failed {where}")
        if isinstance(exc, PeerLost):  # from shared memory: a peer process of this host ended
            return PeerLost(f"{op} failed {where}: {exc}")
        if exc is None or "timed out" in text.lower() or "timeout" in text.lower():
            detail = f" ({text})" if text else ""
            return CollectiveTimeout(
                f"{op} did not complete within {self.timeout_s:g} s {where}: a peer rank is "
                f"missing (crashed, hung, or calling collectives in another order){detail}")
        return CollectiveTimeout(f"{op} failed {where}: {text} (a peer rank crashed, or calls "
                                 "collectives in another order?)")

    def all_gather(self, array: np.ndarray, op: str, while_waiting: Callable[[], Any] | None = None,
                   released: Released | None = None) -> np.ndarray:
        """Stack ``array`` from every rank: ``[world_size, *array.shape]`` (numpy in and out).

        ``while_waiting`` runs between issuing and waiting (:meth:`_overlap`), so local
        work overlaps the exchange; the wait runs inside ``released()`` (a pipelined
        buffer's shard lock let go, so the learner's thread can write meanwhile).
        """
        array = np.ascontiguousarray(array)
        out = np.empty((self.world_size, *array.shape), array.dtype)
        # gloo's all_gather is a ring: K-1 dependent steps, each a round trip (a send waits
        # for the receiver's "ready", posted once its previous step is done). Its
        # all_to_all sends to every peer at once: one round trip at any K.
        gather, k = self.backend != "gloo", self.world_size
        send = array.reshape(1, -1) if gather else array.reshape(1, -1).repeat(k, 0)
        self._run(out.reshape(k, array.size), send, None, None, op, while_waiting, released, gather)
        return out

    def all_reduce_sum(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Element-wise sum over ranks (returns a new tensor)."""
        if self.same_host is not None or self.hierarchy is not None:
            return torch.from_numpy(self.all_gather(tensor.cpu().numpy(), op).sum(0))
        tensor = tensor.to(self.device).clone()
        self._wait(dist.all_reduce(tensor, group=self.group, async_op=True), op, None)
        return tensor

    def all_to_all(self, send: np.ndarray, send_splits: list[int], recv_splits: list[int],
                   op: str, while_waiting: Callable[[], Any] | None = None,
                   released: Released | None = None) -> np.ndarray:
        """Send rows ``send_splits[r]`` of ``send`` to rank ``r``; receive ``recv_splits``
        (numpy in and out). ``while_waiting`` and ``released`` as in :meth:`all_gather`."""
        send = np.ascontiguousarray(send)
        recv = np.empty((sum(recv_splits), *send.shape[1:]), send.dtype)
        return self._run(recv, send, recv_splits, send_splits, op, while_waiting, released)

    def _run(self, recv: np.ndarray, send: np.ndarray, recv_splits: list[int] | None,
             send_splits: list[int] | None, op: str, while_waiting: Callable[[], Any] | None,
             released: Released | None, gather: bool = False) -> np.ndarray:
        """Issue ``all_to_all_single`` (splits in rows; None: equal), or with ``gather``
        ``all_gather_into_tensor``, through shared memory (and the hosts' leaders) or on the
        group; ``recv`` filled."""
        k = self.world_size
        via = self.same_host or self.hierarchy
        if via is not None:
            row = send.itemsize * math.prod(send.shape[1:])
            work: Any = via.post(recv.reshape(-1).view(np.uint8), send.reshape(-1).view(np.uint8),
                                 [n * row for n in send_splits or [send.shape[0] // k] * k],
                                 [n * row for n in recv_splits or [recv.shape[0] // k] * k])
            self._overlap(work, op, while_waiting, released)
            return recv
        into, out = (torch.from_numpy(a).to(self.device) for a in (recv, send))
        group = self.group
        if gather:
            work = dist.all_gather_into_tensor(into.reshape(-1), out.reshape(-1), group=group, async_op=True)
        else:
            work = dist.all_to_all_single(into, out, recv_splits, send_splits, group=group, async_op=True)
        self._overlap(work, op, while_waiting, released)
        if into.device.type != "cpu":
            recv[...] = into.cpu().numpy()
        return recv

    def _overlap(self, work: Any, op: str, while_waiting: Callable[[], Any] | None,
                 released: Released | None) -> None:
        """Run ``while_waiting`` and then wait for ``work``, also when it raises (the ranks
        stay in step); its error propagates after the wait."""
        try:
            if while_waiting is not None:
                while_waiting()
        finally:
            self._wait(work, op, released)


class _Leaders:
    """The leaders' gloo group of a :class:`Hierarchy`: an all_to_all of bytes; close."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def post(self, recv: np.ndarray, send: np.ndarray, send_sizes: list[int], recv_sizes: list[int]) -> Any:
        """Start the leaders' all_to_all of bytes (arguments as ``SameHost.post``'s)."""
        return dist.all_to_all_single(torch.from_numpy(recv), torch.from_numpy(send), recv_sizes, send_sizes,
                                      group=self.group, async_op=True)

    def close(self) -> None:  # its connections close once nothing refers to it
        if dist.is_initialized():
            dist.destroy_process_group(self.group)

