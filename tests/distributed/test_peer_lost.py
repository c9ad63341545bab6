"""A peer rank whose process ends breaks its gloo connections: the ranks left get
``PeerLost`` at once, saying a peer stopped answering, not a raw gloo message nor "did
not complete within N s" long before N seconds passed.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from shardreplay.distributed.group import Collectives
from shardreplay.errors import CollectiveTimeout, PeerLost
from tests.support import run_ranks

pytestmark = pytest.mark.distributed
TIMEOUT_S = 60.0


def _peer_leaves(rank: int, world: int) -> dict:
    coll = Collectives(timeout_s=TIMEOUT_S)
    coll.all_reduce_sum(torch.ones(4), "warm-up")  # every rank is there
    if rank == 1:
        return {}  # this process ends now: its connections close
    time.sleep(1.0)
    start = time.monotonic()
    try:
        for _ in range(100):
            coll.all_reduce_sum(torch.ones(4), "step counters")
    except CollectiveTimeout as exc:
        return {"type": type(exc).__name__, "lost": isinstance(exc, PeerLost), "error": str(exc),
                "seconds": time.monotonic() - start}
    return {"error": None}


def test_a_peer_that_ends_gives_peer_lost_at_once() -> None:
    rank0, _ = run_ranks(_peer_leaves, 2, timeout_s=120)
    assert rank0["error"] is not None, "the collective did not fail"
    assert rank0["lost"], rank0
    error = rank0["error"]
    assert "step counters failed on rank 0 of 2" in error, error
    assert "a peer rank stopped answering (its process died?)" in error, error
    # The node is named: by gloo's address of the broken connection, and its host name.
    assert re.match(r"lost learner node (\S+ \()?127\.0\.0\.1\)?: ", error), error
    assert "did not complete within" not in error and "GLHF" not in error, error
    assert rank0["seconds"] < TIMEOUT_S / 4, rank0
