"""Bodies of the child processes of ``test_faults.py`` (kept light: a spawned child imports
this module, not the test module).

- :func:`write_forever`: an actor's writer sending chunks of known content until killed.
- :func:`write_n`: an actor's writer sending a known number of small chunks.
- :func:`reader_life`: one life of a learner that stores chunks exactly once
  (receive -> write into the buffer -> checkpoint -> acknowledge), killed by the test.
- :func:`read_forged`: a reader that receives forged chunks and reports its peak RSS.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from shardreplay.spec import Field, Spec
from tests.runtime.runtime_helpers import IDENT_SPEC, ingest_record, make_chunk


def big_spec(obs_size: int) -> Spec:
    """IDENT_SPEC with a large observation (chunks of megabytes: slow to write)."""
    return Spec({**IDENT_SPEC.fields, "obs": Field((obs_size,), np.float32)})


def write_forever(transport: Any, actor_id: int, first_seq: int, obs_size: int, s: int, t: int) -> None:
    """Send chunks ``first_seq, first_seq + 1, ...`` until killed."""
    spec = big_spec(obs_size)
    writer = transport.writer()
    seq = first_seq
    while True:
        writer.send(make_chunk(actor_id, seq, s=s, t=t, spec=spec, obs_size=obs_size), timeout_s=None)
        seq += 1


def write_n(transport: Any, actor_id: int, count: int) -> None:
    """Send chunks ``0 .. count - 1`` of ``actor_id`` (small ones), then return."""
    writer = transport.writer()
    for seq in range(count):
        writer.send(make_chunk(actor_id, seq, s=1, t=2), timeout_s=60)
    writer.close()


def _write_json(path: Path, body: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)


def reader_life(transport: Any, root: str, num_actors: int, capacity: int, life_file: str,
                die_after_save: bool) -> None:
    """One learner life: restore the newest complete checkpoint and its stored chunks,
    then forever: receive and write (no ack), save a checkpoint, acknowledge.

    ``die_after_save``: SIGKILL itself right after its first save, before acknowledging
    (the window that re-delivers chunks already in the checkpoint). Progress goes to
    ``life_file`` (JSON) after every step, for the test to watch.
    """
    from shardreplay import checkpoint
    from shardreplay.buffer.replay_buffer import ReplayBuffer
    from shardreplay.runtime.learner.ingest import Ingestor, merge_stored
    from shardreplay.runtime.policy_file import learner_records
    from shardreplay.runtime.settings import TrainSettings

    settings = TrainSettings.from_dict(dict(learners=1, actors=num_actors, envs_per_actor=2, transport="file:///unused"))
    buffer = ReplayBuffer(IDENT_SPEC, num_streams=2 * num_actors, stream_capacity=capacity, window=2)
    stored = None
    ids = checkpoint.list_checkpoints(Path(root))
    restored = None
    if any(checkpoint.is_complete(checkpoint.checkpoint_dir(Path(root), i)) for i in ids):
        report = checkpoint.load(root, buffer, fallback=True)
        restored = report.checkpoint_id
        assert report.manifest is not None
        stored = merge_stored(r.ingest for r in learner_records(report.manifest))
    ingestor = Ingestor(transport.reader(), buffer, settings, stored)
    next_id = max(ids, default=-1) + 1
    progress = {"pid": os.getpid(), "restored": restored, "saves": 0, "steps": buffer.num_steps,
                "duplicates": 0, "acked": 0}
    _write_json(Path(life_file), progress)
    while True:
        ingestor.drain(8, 0.05, 0, ack=False)
        if ingestor.take_stats().duplicates:
            progress["duplicates"] = ingestor.total_duplicates
        if ingestor._unacked:
            checkpoint.save(buffer, root, next_id, files=ingest_record(ingestor), keep_last=2)
            next_id += 1
            progress["saves"] += 1
            if die_after_save:
                os.kill(os.getpid(), signal.SIGKILL)
            progress["acked"] += ingestor.ack_stored()
        progress["steps"] = buffer.num_steps
        _write_json(Path(life_file), progress)


def read_forged(transport: Any, out_file: str, expect_valid: int, timeout_s: float) -> None:
    """Receive until ``expect_valid`` valid chunks came (forged ones in between); report
    the reader's stats and its peak RSS before and after (``out_file``, JSON)."""
    import psutil

    reader = transport.reader()
    got: list[tuple[int, int]] = []
    deadline = time.monotonic() + timeout_s

    def take(n: int, max_chunks: int) -> None:
        while len(got) < n and time.monotonic() < deadline:
            chunks = reader.receive(max_chunks, timeout_s=0.1)
            reader.ack(chunks)
            got.extend(c.identity for c in chunks)

    take(1, 1)  # the first valid chunk warms the reader up; the forged ones follow it
    before_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    before_rss = psutil.Process().memory_info().rss
    take(expect_valid, 16)
    _write_json(Path(out_file), {
        "valid": got, "stats": reader.stats.as_dict(),
        "peak_before": before_peak, "peak_after": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_before": before_rss, "rss_after": psutil.Process().memory_info().rss})
    reader.close()
