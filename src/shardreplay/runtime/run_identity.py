"""Which run a learner life belongs to: ``<run_dir>/run.json`` = ``{"run_id", "life"}``.

The run id is made once per run directory (the first ``shardreplay train`` there) and
kept by every later start of it (``--resume``, ``--auto-resume``, or a new start over a
directory without checkpoints), so a resumed run still reads the chunks its previous
life's actors left on the medium. Channels on a shared medium (Redis streams, spool
directories) are named after it, so a new run never reads an old run's chunks.

``life`` counts the starts of the run directory (0 for the first): the high part of
every policy version the learner publishes (:func:`shardreplay.policy.broadcast.pack_version`),
so versions stay ordered across resumes, also from an older checkpoint.

A run directory started before run ids (``config.json`` but no ``run.json``) keeps the
unnamed channels (run id ``""``) its actors used, and its next start is life 1.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RUN_FILE", "RunIdentity", "next_life", "read_identity"]

RUN_FILE = "run.json"


@dataclass(frozen=True)
class RunIdentity:
    """A run's id and the learner life counter (see the module docstring)."""

    run_id: str
    life: int


def read_identity(run_dir: Path) -> RunIdentity | None:
    """The identity saved in ``run_dir`` (None when there is none yet or it is unreadable:
    a run directory made before run ids existed)."""
    try:
        raw = json.loads((Path(run_dir) / RUN_FILE).read_text())
        return RunIdentity(str(raw["run_id"]), int(raw["life"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def next_life(run_dir: Path) -> RunIdentity:
    """Start a learner life in ``run_dir``: keep its run id (or make one) and count the
    life; writes ``run.json`` atomically. Call it once per start, on one rank.

    Raises:
        OSError: ``run.json`` could not be written.
    """
    old = read_identity(run_dir)
    if old is not None:
        ident = RunIdentity(old.run_id, old.life + 1)
    elif (Path(run_dir) / "config.json").exists() and not (Path(run_dir) / RUN_FILE).exists():
        # Started before run ids: its actors wrote to the unnamed channels, and its
        # policies were plain update counts (life 0). Keep those channels (this life
        # reads what they left) and count this start as life 1 (its versions are newer).
        ident = RunIdentity("", 1)
    else:
        ident = RunIdentity(secrets.token_hex(6), 0)
    tmp = Path(run_dir) / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps({"run_id": ident.run_id, "life": ident.life}))
    tmp.replace(Path(run_dir) / RUN_FILE)
    return ident
