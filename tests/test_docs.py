"""The documents hold: every relative link resolves inside the repository, the README's quick
start is ``make demo`` / ``make test``, and the README's library examples run as printed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support import child_env, torchrun

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
INLINE_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def documents() -> list[Path]:
    """The user-facing markdown files: README, CHANGELOG, docs, benchmarks, examples, deploy."""
    found = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    for folder in ("docs", "benchmarks", "examples", "deploy"):
        found += sorted((ROOT / folder).rglob("*.md"))
    return [p for p in found if p.is_file()]


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced code block, in order."""
    return [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code (links there are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    """Targets of inline, image and reference-style links."""
    body = prose(text)
    return INLINE_LINK.findall(body) + REFERENCE_LINK.findall(body)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Anchors of the headings of a markdown file (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(doc: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of ``doc`` that names no file or folder under ``root`` (the
    repository), or a heading its markdown target does not have."""
    problems = []
    for target in links(doc.read_text()):
        if target.startswith(EXTERNAL):
            continue
        path_part, _, fragment = target.partition("#")
        resolved = (doc.parent / path_part).resolve() if path_part else doc
        if not resolved.is_relative_to(root.resolve()):
            problems.append(f"{target}: outside the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            problems.append(f"{target}: {resolved.name} has no heading #{fragment}")
    return problems


def test_documents_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in documents()}
    assert {"README.md", "CHANGELOG.md", "docs/semantics.md", "docs/multi-machine.md",
            "benchmarks/replay/RESULTS.md"} <= names, names


@pytest.mark.parametrize("doc", documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves_inside_the_repository(doc: Path) -> None:
    assert broken_links(doc) == []


def test_link_check_catches_bad_links(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "README.md").write_text("# Title\n")
    (repo / "docs" / "semantics.md").write_text("# Semantics\n\n## Sharded sampling\n")
    (tmp_path / "outside.md").write_text("# Outside\n")
    doc = repo / "docs" / "probe.md"
    doc.write_text("# Probe\n\n[ok](semantics.md#sharded-sampling) [self](#probe) "
                   "[gone](nothing-here.md) [out](../../outside.md) [web](https://example.org/x.md) "
                   "[anchor](semantics.md#no-such-heading) `[code](not-a-link.md)`\n"
                   "[ref]: ../README.md#no-such-heading\n")
    problems = broken_links(doc, root=repo)
    assert problems == ["nothing-here.md: no such file", "../../outside.md: outside the repository",
                        "semantics.md#no-such-heading: semantics.md has no heading #no-such-heading",
                        "../README.md#no-such-heading: README.md has no heading #no-such-heading"]


def test_slugs_follow_github() -> None:
    assert slug("Sharded sampling") == "sharded-sampling"
    assert slug("Runs, learner lives and policy versions") == "runs-learner-lives-and-policy-versions"
    assert slug("`make demo` results, 2026-11-21") == "make-demo-results-2026-11-21"


def section(text: str, title: str) -> str:
    """The body of the ``## title`` section, up to the next heading of level 1 or 2 (lines in
    code blocks that start with ``#`` are not headings)."""
    body: list[str] | None = None
    in_fence = False
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and re.match(r"#{1,2} ", line):
            if body is not None:
                break
            if line.rstrip("\n") == f"## {title}":
                body = []
                continue
        if body is not None:
            body.append(line)
    assert body is not None, f"README has no '## {title}' section"
    return "".join(body)


def test_quick_start_is_make_demo_and_make_test() -> None:
    blocks = code_blocks(section(README.read_text(), "Quick start"))
    assert blocks, "the quick start has no code block"
    commands = [line.split("#")[0].strip() for line in blocks[0][1].splitlines()]
    assert [c for c in commands if c] == ["make demo", "make test"]
    targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert {"demo", "test"} <= set(targets)


def library_examples() -> tuple[str, str]:
    """The README's two python examples: (single buffer, sharded under torchrun)."""
    blocks = [body for info, body in code_blocks(section(README.read_text(), "The library"))
              if info == "python"]
    assert len(blocks) == 2, f"expected 2 python blocks under '## The library', got {len(blocks)}"
    single, sharded = blocks
    assert "ShardedReplayBuffer" not in single and "ShardedReplayBuffer(" in sharded
    return single, sharded


def test_readme_single_buffer_example_runs() -> None:
    single, _ = library_examples()
    assert len(single.strip().splitlines()) <= 22, "keep the example short"
    scope: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(single, f"{README}:single-buffer example", "exec"), scope)
    buffer, batch = scope["buffer"], scope["batch"]
    assert tuple(batch.data["obs"].shape) == (32, 2, 4)
    assert tuple(batch.weights.shape) == (32,) and tuple(batch.keys.shape) == (32,)
    assert float(batch.weights.max()) == pytest.approx(1.0)
    assert buffer.num_steps == 8 * 17  # one add and a 16-step extend per stream
    assert len(buffer) == 8 * 16  # every step but the newest starts a full 2-step window
    assert buffer.info().stale_updates == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_readme_sharded_example_runs_under_torchrun(tmp_path: Path) -> None:
    _, sharded = library_examples()
    header = sharded.splitlines()[0]
    assert header.startswith("# sharded.py; run: torchrun --nproc-per-node 2 sharded.py"), header
    script = tmp_path / "sharded.py"
    script.write_text(sharded)
    log = tmp_path / "torchrun.log"
    env = child_env()
    cmd = torchrun(2, str(script))
    with open(log, "wb") as sink:  # a file, not a pipe: a full pipe would block the ranks
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                start_new_session=True)
    deadline = time.monotonic() + 180
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        if proc.poll() is None:  # timed out or interrupted: end torchrun and its ranks
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"torchrun did not finish in 180 s:\n{log.read_text()}")
    out = log.read_text()
    assert proc.returncode == 0, out
    assert "rank 0: 32 windows" in out and "rank 1: 32 windows" in out, out


def test_the_porting_diff_and_the_dqn_example_leave_cleanrls_summary_writer_alone() -> None:
    # CleanRL names its TensorBoard SummaryWriter ``writer``; a step writer bound to the
    # same name breaks the first ``writer.add_scalar`` of the ported script.
    diff = "\n".join(body for lang, body in FENCE.findall((ROOT / "docs" / "porting.md").read_text())
                     if lang.strip() == "diff")
    added = [line[1:] for line in diff.splitlines() if line.startswith("+")]
    example = (ROOT / "examples" / "cleanrl_dqn.py").read_text().splitlines()
    for where, lines in (("docs/porting.md", added), ("examples/cleanrl_dqn.py", example)):
        rebound = [line for line in lines if re.search(r"(?<![\w.])writer\s*=(?!=)", line)
                   and "SummaryWriter" not in line]
        assert not rebound, f"{where} binds the step writer to CleanRL's name 'writer': {rebound}"
        assert any("rb_writer.step(" in line for line in lines), where


# -- issue 40: every command of the documents runs in the suite, or says why not -----------------
COMMAND_DOCS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
BASH = re.compile(r"^(?P<indent>[ \t]*)```bash[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
MARK = re.compile(r"<!-- (?:runs in (?P<test>tests/\S+\.py)[^>]*|not runnable here: (?P<why>[^>]+?)) -->\s*$")
BARE = re.compile(r"^ {4}(shardreplay|make|torchrun|python) ", re.M)  # an indented, unfenced command


def bash_blocks(doc: str) -> list[tuple[str, str, str]]:
    """(the line before the block, body, doc) of every ``bash`` block of ``doc``."""
    text = (ROOT / doc).read_text()
    found = []
    for m in BASH.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        found.append((before, m.group("body"), doc))
    return found


def commands(body: str) -> list[str]:
    """A block's commands: comments dropped, continued lines joined."""
    text = re.sub(r"(?m)\s*#.*$", "", body).replace("\\\n", " ")
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def test_every_bash_block_of_the_documents_runs_in_a_test_or_says_why_not() -> None:
    """Each ``bash`` block of README.md and docs/*.md is preceded by ``<!-- runs in
    tests/X.py ... -->`` (that test reads the document and runs its commands) or ``<!-- not
    runnable here: REASON -->``; no command hides in an unfenced indented block."""
    blocks = [b for doc in COMMAND_DOCS for b in bash_blocks(doc)]
    assert len(blocks) >= 14, blocks
    runs, skipped = [], []
    for before, body, doc in blocks:
        mark = MARK.search(before)
        assert mark, f"{doc}: a bash block without a runs-in or not-runnable mark: {commands(body)}"
        if mark["test"]:
            test = ROOT / mark["test"]
            assert test.is_file() and Path(doc).name in test.read_text(), (doc, mark["test"])
            runs.append(doc)
        else:
            skipped.append((doc, mark["why"]))
    assert runs and skipped
    for doc in COMMAND_DOCS:
        assert not BARE.search(prose((ROOT / doc).read_text())), f"{doc}: a command outside a bash block"


def _doc_commands_run_here() -> list[str]:
    """The commands of the blocks marked ``runs in tests/test_docs.py`` (README.md and
    docs/train.md), each once."""
    found: list[str] = []
    for doc in ("README.md", "docs/train.md"):
        for before, body, _doc in bash_blocks(doc):
            mark = MARK.search(before)
            if mark and mark["test"] == "tests/test_docs.py":
                found += [c for c in commands(body) if c not in found]
    return found


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(900)
def test_the_documents_train_commands_run_with_a_small_step_budget(tmp_path: Path, redis_server) -> None:
    """README.md's and docs/train.md's commands as typed, in a fresh directory, each
    ``train`` with a step budget appended (flags given last win): train's own defaults
    otherwise, progress bar and learning curve included. ``runs/RUN`` is the first run's
    directory, ``my.yaml`` a settings file, the Redis at 127.0.0.1:6379 the test's server."""
    import shlex
    import sys

    cmds = _doc_commands_run_here()
    assert len(cmds) == 7 and cmds[0].startswith("shardreplay train --learners 2"), cmds
    (tmp_path / "my.yaml").write_text("replay:\n  alpha: 0.6\nactors: 1\n")
    budget = ["--total-env-steps", "300", "--min-replay", "100", "--max-minutes", "3", "--eval-episodes", "2"]
    env = child_env()
    for i, line in enumerate(cmds):
        runs = sorted((tmp_path / "runs").iterdir()) if (tmp_path / "runs").is_dir() else []
        line = line.replace("redis://127.0.0.1:6379/0", redis_server.url)
        if runs:
            line = line.replace("runs/RUN", str(runs[0].relative_to(tmp_path)))
        argv = shlex.split(line)
        assert argv[0] == "shardreplay", line
        if argv[1] == "train":
            argv += budget if "--resume" not in argv else [*budget[:1], "600", *budget[2:]]
        done = subprocess.run([sys.executable, "-m", "shardreplay", *argv[1:]], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        assert "Traceback" not in done.stderr, f"{line}\n{done.stderr}"
        if argv[1] == "train":
            (last,) = done.stdout.splitlines()
            assert last.startswith(("Solved", "Not solved")) and "learning_curve.png" in last, (line, last)
        assert i > 0 or len(list((tmp_path / "runs").iterdir())) == 1
