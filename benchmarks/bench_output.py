"""How every benchmark hands out its figures: one JSON line on stdout, also written to --out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit_line(line: dict[str, Any], out: Path | None) -> None:
    """Print ``line`` as one JSON line and, when ``out`` is given, write it there too."""
    text = json.dumps(line)
    print(text, flush=True)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
