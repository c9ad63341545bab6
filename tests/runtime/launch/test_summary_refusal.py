"""The launcher names in summary.json a write that another rank's file system refused
(rank 0 writes the summary and names only its own): which rank meets a full disk first
is a matter of timing, and the summary must say it either way."""

from __future__ import annotations

import json
from pathlib import Path

from shardreplay.runtime.launch.launcher import _name_refusal_in_summary


def test_rank_0_s_summary_gets_another_rank_s_refused_write(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"stopped_by": "storage", "env_steps": 7}))
    refused = "no space left on device: /run/ingest/shard-1"
    _name_refusal_in_summary(str(tmp_path), refused)
    assert json.loads((tmp_path / "summary.json").read_text()) == {
        "stopped_by": "storage", "env_steps": 7, "storage_error": refused}


def test_without_a_summary_nothing_is_written_and_nothing_raised(tmp_path: Path) -> None:
    _name_refusal_in_summary(str(tmp_path), "refused")
    assert not (tmp_path / "summary.json").exists()
