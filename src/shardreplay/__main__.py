"""``python -m shardreplay``: the ``shardreplay`` command (also for ``torchrun -m shardreplay``)."""

from __future__ import annotations

from shardreplay.cli.main import console

if __name__ == "__main__":
    console()
