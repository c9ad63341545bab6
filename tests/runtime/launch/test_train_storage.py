"""``shardreplay train`` when the file system refuses a write (issue 19, items 5 and 6,
and the file-system half of the fault sweep).

Each cell puts one target of the run on its own tiny tmpfs and makes a real write fail
there: no mocks, no hooks. A checkpoint part and the manifest fail by running out of
inodes (tmpfs answers ENOSPC; a checkpoint of one rank creates exactly five files, so the
count picks the write), the policy and the ingest log by filling their file system
once the run has a complete checkpoint, a spool by being smaller than the actors' queue.
A read-only run directory and a read-only spool are read-only tmpfs mounts (root ignores
``chmod``). Every failing cell must end with exit code 2, exactly one stderr line naming
the path and the OS error, no traceback, summary.json and the closing sentence where the
run got that far, the newest complete checkpoint still complete, and, once space is
freed, ``--auto-resume`` completing the run.

Each cell runs twice: with ``FAST`` (no progress bar, no learning curve), and once more
with ``train``'s defaults for them (the bar and the curve on), as a user types the command:
issue 40 found the curve's drawing on a full disk ending such a run in a traceback. The
defaults run checks the failing run only; the ``--auto-resume`` after it is the fast
cell's (the same continuation, and a run to completion with the curve is tested elsewhere).

Mounting needs root; elsewhere every cell is skipped, saying why. About 3 minutes on 2 cores;
the defaults cells add about 100 CPU-seconds.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardreplay import checkpoint
from tests.support.train_runs import DEFAULTS, FAST, TrainRun, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Small, quick runs: a tiny network (its learner state and weights are a few KB), a
# checkpoint every 50 updates, a budget the failures cut short.
_SMALLER = ("--hidden", "16", "--checkpoint-interval-updates", "50", "--max-minutes", "1")
SMALL = (*FAST, *_SMALLER)
SMALL_DEFAULTS = (*DEFAULTS, *_SMALLER)
LONG = ("--total-env-steps", "100000")
NO_SPACE = "No space left on device (ENOSPC)"
READ_ONLY = "Read-only file system (EROFS)"


@pytest.fixture(params=[SMALL, SMALL_DEFAULTS], ids=["fast", "defaults"])
def flags(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """The cell's ``train`` flags: ``SMALL``, or the same with the bar and the curve on."""
    return tuple(request.param)


def _resumes(flags: tuple[str, ...]) -> bool:
    """Whether the cell goes on to its ``--auto-resume`` (the fast one; see the docstring)."""
    return flags == SMALL


@pytest.fixture
def tmpfs() -> Iterator[Callable[..., Path]]:
    """``mount(path, options)``: a tmpfs mounted at ``path`` (made if missing), unmounted
    after the test; skips the test where mounting is not possible."""
    mounted: list[Path] = []
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the file-system fault matrix runs as root in CI)")

    def mount(path: Path, options: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(path)
        return path

    try:
        yield mount
    finally:
        for path in reversed(mounted):
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _remount(path: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)


def _fill(directory: Path) -> Path:
    """Write zeros under ``directory`` until its file system is full; returns the file."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, bytes(4096))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    return filler


def _keep_full(directory: Path, run: TrainRun, timeout_s: float = 90) -> Path:
    """Keep ``directory``'s file system full until the run exits (what the run frees,
    the filler takes, as another writer on a full disk would); returns the filler."""
    deadline = time.monotonic() + timeout_s
    while run.proc.poll() is None and time.monotonic() < deadline:
        filler = _fill(directory)
        time.sleep(0.02)
    run.wait(10)
    return filler


def _train(args: list[str], log_dir: Path, prefix: str, timeout_s: float = 120) -> TrainRun:
    with TrainRun(["train", *args], log_dir, prefix=prefix) as run:
        run.wait(timeout_s)
        assert run.leftovers() == [], run.explain()
        return run


def _first_complete(run_dir: Path) -> int:
    root = run_dir / "checkpoints"
    wait_until(lambda: checkpoint.latest_complete(root) is not None, 60, "a first complete checkpoint")
    newest = checkpoint.latest_complete(root)
    assert newest is not None
    return newest


def _assert_one_line(run: TrainRun, path_part: str, os_error: str) -> str:
    """Exit 2, no traceback, exactly one stderr line naming the OS error; it names the path."""
    err = run.stderr()
    assert run.proc.returncode == 2, run.explain()
    assert "Traceback" not in err, run.explain()
    lines = [line for line in err.splitlines() if os_error in line]
    assert len(lines) == 1, run.explain()
    assert path_part in lines[0] and lines[0].startswith("shardreplay train: "), lines[0]
    return lines[0]


def _assert_stopped_cleanly(run: TrainRun, run_dir: Path, kept: int) -> None:
    """The closing sentence and summary.json are there, and the newest complete
    checkpoint is ``kept`` or a newer one (saves before the failure, or the final one)."""
    assert run.stdout().startswith("Stopped: the file system refused a write"), run.explain()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "storage" and summary["storage_error"], summary
    newest = checkpoint.latest_complete(run_dir / "checkpoints")
    assert newest is not None and newest >= kept


def _auto_resume_completes(run_dir: Path, log_dir: Path, extra: tuple[str, ...] = ()) -> dict:
    run = _train(["--run-dir", str(run_dir), "--auto-resume", *SMALL, "--total-env-steps", "1500", *extra],
                 log_dir, "resumed-")
    assert run.proc.returncode == 0, run.explain()
    assert "Traceback" not in run.stderr(), run.explain()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "env_steps" and not summary.get("storage_error"), summary
    return summary


@pytest.mark.parametrize(("inodes", "refused"),
                         [(10, "part-00000-of-00001.safetensors"), (12, "manifest.json")],
                         ids=["checkpoint-part", "manifest"])
def test_a_full_disk_during_a_checkpoint_keeps_the_older_one_and_resumes(
        tmp_path: Path, tmpfs: Callable[..., Path], flags: tuple[str, ...], inodes: int,
        refused: str) -> None:
    # One rank's checkpoint creates six inodes (its directory, its learner record, the
    # learner state, the part, its description, the manifest); the mount's root takes one.
    # So the second checkpoint runs out at its part (10) or at its manifest (12).
    run_dir = tmp_path / "run"
    ckpts = tmpfs(run_dir / "checkpoints", f"size=4m,nr_inodes={inodes}")
    run = _train(["--run-dir", str(run_dir), *flags, *LONG], tmp_path, "full-")
    line = _assert_one_line(run, refused, NO_SPACE)
    first = checkpoint.list_checkpoints(ckpts)[0]
    assert f"the newest complete checkpoint is {checkpoint.checkpoint_dir(ckpts, first).name}" in line
    _assert_stopped_cleanly(run, run_dir, first)
    assert checkpoint.latest_complete(ckpts) == first  # the failed one is not complete
    if _resumes(flags):
        _remount(ckpts, "nr_inodes=10000")
        summary = _auto_resume_completes(run_dir, tmp_path)
        assert summary["resumed_from"]["checkpoint_id"] == first


def test_a_full_policy_directory_ends_the_run_with_one_line_and_resumes(
        tmp_path: Path, tmpfs: Callable[..., Path], flags: tuple[str, ...]) -> None:
    run_dir = tmp_path / "run"
    policy = tmpfs(run_dir / "policy", "size=256k")
    with TrainRun(["train", "--run-dir", str(run_dir), *flags, *LONG], tmp_path, prefix="full-") as run:
        first = _first_complete(run_dir)
        filler = _fill(policy)
        run.wait(90)
        assert run.leftovers() == [], run.explain()
    # The file refused is the next policy's or, when the fill lands between a publish's two
    # writes, the version file's: either way one line naming a path in the policy directory.
    _assert_one_line(run, f"{policy}/policy", NO_SPACE)
    _assert_stopped_cleanly(run, run_dir, first)
    if _resumes(flags):
        filler.unlink()
        _auto_resume_completes(run_dir, tmp_path)


def test_a_full_run_directory_ends_the_run_with_one_line_and_resumes(
        tmp_path: Path, tmpfs: Callable[..., Path], flags: tuple[str, ...]) -> None:
    # Issue 40: the whole run directory full once the run has a checkpoint, so that every
    # write of the run's end is refused too (metrics, summary.json, the learning curve):
    # with the curve on, its drawing ended the run in a traceback (UnboundLocalError).
    run_dir = tmpfs(tmp_path / "run", "size=2m")
    with TrainRun(["train", "--run-dir", str(run_dir), *flags, *LONG], tmp_path, prefix="full-") as run:
        first = _first_complete(run_dir)
        filler = _keep_full(run_dir, run)
        assert run.leftovers() == [], run.explain()
    _assert_one_line(run, str(run_dir), NO_SPACE)
    assert run.stdout().startswith("Stopped: the file system refused a write"), run.explain()
    assert checkpoint.latest_complete(run_dir / "checkpoints") >= first  # type: ignore[operator]
    if _resumes(flags):
        filler.unlink()
        _auto_resume_completes(run_dir, tmp_path)


def test_a_full_ingest_log_on_one_of_two_ranks_stops_both_and_resumes(
        tmp_path: Path, tmpfs: Callable[..., Path], flags: tuple[str, ...]) -> None:
    # A checkpoint starts a new log segment: its first record needs a new page, which a
    # full file system refuses (on one rank or both; the first refusal is reported).
    run_dir = tmp_path / "run"
    ingest = tmpfs(run_dir / "ingest", "size=256k")
    args = ["--run-dir", str(run_dir), *flags, "--learners", "2", "--actors", "2", *LONG]
    with TrainRun(["train", *args], tmp_path, prefix="full-") as run:
        first = _first_complete(run_dir)
        filler = _keep_full(ingest, run)  # a checkpoint deletes the segments it covers
        assert run.leftovers() == [], run.explain()
    _assert_one_line(run, str(ingest / "shard-"), NO_SPACE)
    _assert_stopped_cleanly(run, run_dir, first)
    if _resumes(flags):
        filler.unlink()
        _auto_resume_completes(run_dir, tmp_path, ("--learners", "2", "--actors", "2"))


def test_a_full_spool_makes_actors_back_off_and_loses_no_chunk(
        tmp_path: Path, tmpfs: Callable[..., Path], flags: tuple[str, ...]) -> None:
    # Two pages: fewer than the four chunks two actors may queue, so sends fail with
    # ENOSPC until the learner has read (and deleted) some.
    spool = tmpfs(tmp_path / "spool", "size=8k")
    run_dir = tmp_path / "run"
    run = _train(["--run-dir", str(run_dir), *flags, "--actors", "2", "--transport", spool.as_uri(),
                  "--total-env-steps", "2500"], tmp_path, "spool-")
    assert run.proc.returncode == 0, run.explain()
    err = run.stderr()
    assert "Traceback" not in err, run.explain()
    full = [line for line in err.splitlines() if NO_SPACE in line]
    assert 1 <= len(full) <= 2 and all("backing off" in line for line in full), run.explain()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env_steps"] >= 2500 and summary["chunks_rejected"] == 0
    assert not (run_dir / "lost_chunks.jsonl").exists()


def test_a_read_only_run_directory_is_one_line_and_auto_resume_starts_it_later(
        tmp_path: Path, tmpfs: Callable[..., Path], flags: tuple[str, ...]) -> None:
    run_dir = tmpfs(tmp_path / "run", "size=4m,ro")
    run = _train(["--run-dir", str(run_dir), *flags, *LONG], tmp_path, "ro-")
    _assert_one_line(run, str(run_dir), READ_ONLY)
    assert run.stdout() == "" and os.listdir(run_dir) == []
    if _resumes(flags):
        _remount(run_dir, "rw")
        _auto_resume_completes(run_dir, tmp_path)


def test_an_unwritable_spool_is_one_line_and_leaves_no_run_directory(
        tmp_path: Path, tmpfs: Callable[..., Path], flags: tuple[str, ...]) -> None:
    spool = tmpfs(tmp_path / "spool", "size=1m,ro")
    run_dir = tmp_path / "run"
    args = ["--run-dir", str(run_dir), *flags, "--transport", spool.as_uri()]
    run = _train([*args, *LONG], tmp_path, "ro-spool-")
    line = _assert_one_line(run, f"cannot write {spool}", READ_ONLY)
    assert "resume" not in line and not run_dir.exists(), run.explain()
    if _resumes(flags):
        _remount(spool, "rw")
        _auto_resume_completes(run_dir, tmp_path, ("--transport", spool.as_uri()))


def test_a_damaged_part_is_named_and_the_older_checkpoint_offered(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _train(["--run-dir", str(run_dir), *SMALL, "--total-env-steps", "2000"], tmp_path, "a-")
    assert first.proc.returncode == 0, first.explain()
    root = run_dir / "checkpoints"
    older, newest = checkpoint.list_checkpoints(root)[-2:]
    part = checkpoint.checkpoint_dir(root, newest) / "part-00000-of-00001.safetensors"
    with open(part, "r+b") as f:  # one flipped byte
        f.seek(part.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    refused = _train(["--resume", str(run_dir)], tmp_path, "b-", timeout_s=60)
    assert refused.proc.returncode == 2 and "Traceback" not in refused.stderr(), refused.explain()
    (line,) = refused.stderr().splitlines()
    assert f"checkpoint {newest} is damaged" in line and str(part) in line
    assert "checksum mismatch in block" in line
    assert f"--resume {run_dir} --checkpoint-id {older}" in line and "incomplete ones" not in line
    resumed = _train(["--resume", str(run_dir), "--checkpoint-id", str(older), "--total-env-steps", "2300"],
                     tmp_path, "c-")
    assert resumed.proc.returncode == 0, resumed.explain()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"]["checkpoint_id"] == older
    # The damaged one was set aside, not deleted.
    assert list((root / "incomplete").rglob(part.name)), sorted(root.rglob("*"))
