"""Accounting for the end-to-end fault test (``test_e2e_faults.py``).

Three records are compared, each identity being ``(actor_id, sequence)``:

- delivered: the actors' delivery logs (``--delivery-log-dir``), one line per chunk a
  transport accepted;
- stored: ``ingest["stored"]`` of every part's learner record of the final complete checkpoint,
  ``{"<actor_id>": [[lo, hi], ...]}`` inclusive sequence intervals;
- lost: ``<run_dir>/lost_chunks.jsonl``, one ``{"actor_id", "first", "last", "chunks",
  "steps", "reason", "rank"}`` per line, written by learners on resume.

Every delivered identity must be stored, rejected on arrival or lost with a reason, and the
checkpoint's step count must be the sum of the distinct stored chunks' steps (a chunk stored
twice adds its steps twice; the replay capacity is large enough that nothing is overwritten).
The reasons are told apart as docs/semantics.md ("Losses are counted, never silent") does: a
chunk *rejected* on arrival (malformed, another spec, another shard's) was never stored; any
other reason is a *loss*: the chunk was stored and acknowledged, then is in no checkpoint and
no log replay (a crashed learner's, or one the replay rejected).
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardreplay import checkpoint
from shardreplay.runtime.policy_file import learner_records

Identity = tuple[int, int]


def read_delivery_logs(log_dir: Path) -> dict[Identity, int]:
    """Steps of every delivered chunk, from all ``actor-*.jsonl`` under ``log_dir``.

    A line logged twice for one identity is a delivery-log defect: it fails here.
    """
    seen: Counter[Identity] = Counter()
    steps: dict[Identity, int] = {}
    for path in sorted(log_dir.glob("actor-*.jsonl")):
        for line in path.read_text().splitlines():
            d = json.loads(line)
            ident = (int(d["actor_id"]), int(d["sequence"]))
            seen[ident] += 1
            steps[ident] = int(d["steps"])
    twice = sorted(i for i, n in seen.items() if n > 1)
    assert not twice, f"identities logged more than once by actors: {twice[:10]}"
    return steps


def final_checkpoint(run_dir: Path) -> tuple[Path, checkpoint.Manifest]:
    """The newest complete checkpoint of a run and its manifest (library API)."""
    root = run_dir / "checkpoints"
    newest = checkpoint.latest_complete(root)
    assert newest is not None, f"no complete checkpoint under {root}: {checkpoint.list_checkpoints(root)}"
    directory = checkpoint.checkpoint_dir(root, newest)
    return directory, checkpoint.load_manifest(directory)


def stored_identities(manifest: checkpoint.Manifest) -> set[Identity]:
    """The union of the parts' stored-chunk records (``ingest["stored"]`` of each
    part's learner record).

    A union, not a sum: a resumed rank starts from the merged record of all parts (its
    shard may receive any saved shard's episodes), so parts of a later checkpoint can
    list the same chunk. Duplicates show in the step count instead (:func:`stored_steps`).
    """
    held: set[Identity] = set()
    for shard, record in enumerate(learner_records(manifest)):
        ingest = record.ingest or {}
        assert "stored" in ingest, (
            f"part {shard} of the checkpoint records no stored chunk intervals "
            f"(ingest = {json.dumps(ingest)[:200]})")
        for actor, intervals in ingest["stored"].items():
            for lo, hi in intervals:
                assert lo <= hi, f"bad stored interval {lo}..{hi} of actor {actor}"
                held.update((int(actor), q) for q in range(int(lo), int(hi) + 1))
    return held


@dataclass(frozen=True)
class LostRange:
    """One line of ``lost_chunks.jsonl``."""

    actor_id: int
    first: int
    last: int
    steps: int
    reason: str

    def covers(self, ident: Identity) -> bool:
        return ident[0] == self.actor_id and self.first <= ident[1] <= self.last


def read_lost(run_dir: Path) -> list[LostRange]:
    """The learners' journal of lost and rejected chunks (empty when absent)."""
    path = run_dir / "lost_chunks.jsonl"
    if not path.exists():
        return []
    return [LostRange(int(d["actor_id"]), int(d["first"]), int(d["last"]), int(d["steps"]),
                      str(d.get("reason") or "")) for d in map(json.loads, path.read_text().splitlines())]


def pending_in_spool(spool: Path) -> set[Identity]:
    """Chunks still waiting in a ``file://`` spool's ``ready/`` directories."""
    found = set()
    for path in spool.glob("shard-*/ready/*.chunk"):
        actor, seq = path.stem.split("-")
        found.add((int(actor), int(seq)))
    return found


# Reasons of chunks refused on arrival, never stored: the transport's (malformed) and the
# ingest's live path (another spec, another shard's streams). A replay's are "rejected in log
# replay: ...", and a crashed learner's CRASHED: losses.
ARRIVAL_REJECTIONS = ("rejected by the transport: ", "rejected: ")


def rejected_on_arrival(reason: str) -> bool:
    """Whether a ``lost_chunks.jsonl`` reason is a rejection on arrival (the semantics allow
    it: the chunk was never stored), not a loss of a stored and acknowledged chunk."""
    return reason.startswith(ARRIVAL_REJECTIONS)


@dataclass
class Accounting:
    """Where each delivered chunk went. ``unexplained`` and ``lost`` must be empty where
    nothing may be lost (a durable medium, resumed from the newest checkpoint)."""

    delivered: int = 0
    stored: int = 0
    rejected: int = 0
    lost: list[tuple[Identity, str]] = field(default_factory=list)  # with its reason
    unexplained: list[Identity] = field(default_factory=list)

    @property
    def lost_with_reason(self) -> int:
        """Rejected on arrival or lost, with a reason either way."""
        return self.rejected + len(self.lost)

    def line(self, name: str) -> str:
        return (f"{name}: delivered={self.delivered} stored={self.stored} rejected={self.rejected} "
                f"lost={len(self.lost)} unexplained={len(self.unexplained)}")


def account(delivered: set[Identity], held: set[Identity], lost: list[LostRange]) -> Accounting:
    """Sort ``delivered`` into stored / rejected on arrival / lost with a reason / unexplained."""
    out = Accounting(delivered=len(delivered))
    for ident in sorted(delivered):
        if ident in held:
            out.stored += 1
            continue
        reason = next((r.reason for r in lost if r.reason and r.covers(ident)), None)
        if reason is None:
            out.unexplained.append(ident)
        elif rejected_on_arrival(reason):
            out.rejected += 1
        else:
            out.lost.append((ident, reason))
    return out


def stored_steps(held: set[Identity], delivered_steps: dict[Identity, int],
                 nominal_steps: int) -> tuple[int, int]:
    """Steps of the distinct stored identities, and how many of them no actor logged.

    An actor killed between the transport's acceptance and its log line leaves one
    stored chunk unlogged: it was a full chunk (only a stopping actor sends a short
    one, and it logs it), so ``nominal_steps`` counts for it.
    """
    unlogged = [i for i in held if i not in delivered_steps]
    return sum(delivered_steps.get(i, nominal_steps) for i in held), len(unlogged)


def kill9_redis(server: Any) -> None:
    """SIGKILL a ``conftest.RedisServer`` (no AOF rewrite, no goodbye), reap it, and start
    it again on the same port and directory (``appendonly`` as it was)."""
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=10)
    server.proc = None
    server.start()
