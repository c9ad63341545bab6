"""``shardreplay checkpoint inspect|verify`` run as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from shardreplay import checkpoint
from shardreplay.checkpoint.format import BLOCK_BYTES
from shardreplay.checkpoint.summary import summarize
from tests.checkpoint.helpers import T_SCALE, as_shard, fill_random, make_buffer


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardreplay.cli.main", "checkpoint", *args],
                          capture_output=True, text=True, timeout=120)


def _save(root: Path, cid: int, partial: str = "seal") -> None:
    """A checkpoint of two parts."""
    for k in range(2):
        local = make_buffer(3, 40, seed=k)
        fill_random(local, 60, shard=k, seed=cid + k)
        step = b'{"step": %d}' % (cid * 100)
        checkpoint.save(as_shard(local, k, 2), root, cid, files={f"step-{k}.json": step}, partial=partial,
                        keep_last=None)


@pytest.mark.slow  # fresh interpreters or many examples: 20-100 s at load ~9 on 2 cores
def test_inspect_root_and_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    _save(tmp_path, 2, partial="drop")
    # What the parts hold, read with the safetensors library itself.
    prios = np.concatenate([load_file(str(f))["priority"] for f in
                            sorted(checkpoint.checkpoint_dir(tmp_path, 2).glob("*.safetensors"))])
    _save(tmp_path, 3)
    (checkpoint.checkpoint_dir(tmp_path, 3) / "part-00001-of-00002.safetensors").unlink()

    text = _cli("inspect", str(tmp_path))
    assert text.returncode == 0, text.stderr
    assert "3 checkpoint(s)" in text.stdout and "newest complete: 2" in text.stdout
    assert "INCOMPLETE" in text.stdout and "part-00001-of-00002.safetensors: part missing" in text.stdout
    assert "files       step-0.json, step-1.json" in text.stdout and "priorities  min" in text.stdout

    doc = json.loads(_cli("inspect", "--json", str(tmp_path)).stdout)
    assert [(c["checkpoint_id"], c["complete"]) for c in doc["checkpoints"]] == \
        [(1, True), (2, True), (3, False)]
    newest = doc["newest"]
    manifest = checkpoint.load_manifest(checkpoint.checkpoint_dir(tmp_path, 2))
    assert newest["steps"] == manifest.steps == prios.size
    assert newest["num_shards"] == 2 and sorted(newest["files"]) == sorted(manifest.files)
    assert {"step-0.json", "step-1.json"} <= set(manifest.files)
    assert newest["partial"] == manifest.partial and newest["partial"]["dropped_episodes"] > 0
    assert newest["partial_policy"] == ["drop"]
    assert newest["priority"]["count"] == prios.size
    np.testing.assert_allclose([newest["priority"][k] for k in ("min", "mean", "max")],
                               [prios.min(), prios.astype(np.float64).mean(), prios.max()], rtol=1e-6)

    one = json.loads(_cli("inspect", "--json", str(checkpoint.checkpoint_dir(tmp_path, 3))).stdout)
    assert one["complete"] is False and "part missing" in one["reason"]
    assert sorted(p["shard"] for p in one["parts_present"]) == [0, 1]


def _save_big(root: Path, cid: int) -> Path:
    """One part of ~2 MB: its user fields lie past the first block."""
    big = make_buffer(3, 15_000)
    t = np.arange(15_000)
    types = np.where(t % 100 == 0, 0, np.where(t % 100 == 99, 2, 1)).astype(np.uint8)
    home = np.repeat(np.arange(3, dtype=np.int32)[:, None], 15_000, 1)
    big.extend({"obs": np.zeros((3, 15_000, 2), np.float32), "ctr": t[None] * T_SCALE + home,
                "env": home, "home": home, "step_type": np.repeat(types[None], 3, 0)})
    return checkpoint.save(big, root, cid, keep_last=None)


@pytest.mark.slow  # fresh interpreters or many examples: 20-100 s at load ~9 on 2 cores
def test_verify_reports_every_problem(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    directory = _save_big(tmp_path, 3)
    part = directory / "part-00000-of-00001.safetensors"
    assert part.stat().st_size > BLOCK_BYTES + 4096
    data = bytearray(part.read_bytes())
    data[BLOCK_BYTES + 17] ^= 0x40  # in a block of user fields
    part.write_bytes(data)
    assert summarize(directory)["complete"]  # inspect reads descriptions and priorities only
    (checkpoint.checkpoint_dir(tmp_path, 2) / "part-00000-of-00002.safetensors").write_bytes(b"short")
    (checkpoint.checkpoint_dir(tmp_path, 4) / "part-00001-of-00002.safetensors").unlink()

    bad = _cli("verify", str(tmp_path))
    assert bad.returncode == 1
    assert bad.stdout.startswith(f"OK    {checkpoint.checkpoint_dir(tmp_path, 1)}: 2 parts")
    errors = bad.stderr.splitlines()
    assert len(errors) == 3
    assert "ckpt-0000000002" in errors[0] and "truncated" in errors[0]
    assert "part-00000-of-00001.safetensors: checksum mismatch in block 1" in errors[1]
    assert "ckpt-0000000004" in errors[2] and "part missing" in errors[2]

    ok = json.loads(_cli("verify", "--json", str(checkpoint.checkpoint_dir(tmp_path, 1))).stdout)
    assert ok["ok"] and ok["checkpoints"][0]["steps"] == 240

    missing = _cli("verify", str(tmp_path / "nothing-here"))
    assert missing.returncode == 2 and "neither a checkpoint" in missing.stderr
