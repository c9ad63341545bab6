"""Which run a learner life belongs to: ``<run_dir>/run.json`` = ``{"run_id", "life"}``
(the id made at the first start, ``life`` counting the starts). See docs/semantics.md,
"Runs, learner lives and policy versions".
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardreplay._io import atomic_write_bytes
from shardreplay.errors import ConfigError

__all__ = ["RUN_FILE", "RunIdentity", "read_identity", "upcoming_life", "write_life"]

RUN_FILE = "run.json"
_RUN_ID = re.compile(r"^[0-9A-Za-z_-]{1,64}$")


def check_run_id(run_id: str) -> str:
    """``run_id`` if it can name a channel ('' is the unnamed run of before run ids).

    Raises:
        ConfigError: characters a stream key or directory name must not hold.
    """
    if run_id and not _RUN_ID.match(run_id):
        raise ConfigError(f"run id {run_id!r}: use 1-64 letters, digits, '-' or '_'")
    return run_id


@dataclass(frozen=True)
class RunIdentity:
    """A run's id and the learner life counter (see the module docstring)."""

    run_id: str
    life: int


def read_identity(run_dir: Path) -> RunIdentity | None:
    """The identity saved in ``run_dir`` (None when there is none yet or it is unreadable)."""
    try:
        raw = json.loads((Path(run_dir) / RUN_FILE).read_text())
        return RunIdentity(str(raw["run_id"]), int(raw["life"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def upcoming_life(run_dir: Path, wanted: str = "") -> RunIdentity:
    """The identity the next start of ``run_dir`` takes: its run id (``wanted``, or a new
    random one, at the first start) and the life after the last one written. Reads only:
    :func:`write_life` records it.

    Raises:
        ConfigError: ``wanted`` cannot name a channel, or differs from the run's id.
    """
    check_run_id(wanted)
    old = read_identity(run_dir)
    if old is not None:
        if wanted and wanted != old.run_id:
            raise ConfigError(f"{run_dir} holds run {old.run_id or '(unnamed)'}; --run-id {wanted} names "
                              "another run: drop --run-id or use another --run-dir")
        return RunIdentity(old.run_id, old.life + 1)
    return RunIdentity(wanted or secrets.token_hex(6), 0)


def write_life(run_dir: Path, ident: RunIdentity, config: dict[str, Any]) -> None:
    """Record a learner life: ``run.json`` (``ident``) and ``config.json`` (``config``, the
    settings in effect), each atomically. Call it on one rank.

    Raises:
        OSError: a file could not be written.
    """
    for name, content in ((RUN_FILE, {"run_id": ident.run_id, "life": ident.life}),
                          ("config.json", config)):
        # Not fsynced, as before: rewritten at each start, and a lost one is rebuilt.
        atomic_write_bytes(Path(run_dir) / name, json.dumps(content, indent=1).encode(), fsync=False)
