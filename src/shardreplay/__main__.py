"""``python -m shardreplay``: the ``shardreplay`` command (also for ``torchrun -m shardreplay``)."""

from __future__ import annotations

import sys

from shardreplay.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
