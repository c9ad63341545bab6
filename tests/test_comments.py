"""Comments and docstrings state invariants and reasons, not timing diaries: no measured
figures ("~0.2 us cheaper", "2.8 -> ~4.2M steps/s", "took 0.87 s"), no paths or documents
outside the repository (the repository's own docs/ are linked instead). Figures belong in
``benchmarks/*/RESULTS*.md``.

Checked: every module of src/shardreplay. benchmarks/ and examples/ may state figures
(they measure them) but not cite paths or documents outside the repository.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "shardreplay"
ROOT = PACKAGE.parents[1]

NUMBER = r"\d[\d.,]*"
DIARY = [
    (re.compile(rf"~\s?{NUMBER}\s?(ns|us|µs|ms|s)\b"), "an approximate timing"),
    (re.compile(rf"\b{NUMBER}\s?(ns|us|µs)\b"), "a sub-millisecond timing"),
    (re.compile(rf"\b{NUMBER}\s?[kKM]?\s?(steps|updates|samples|chunks|ops)/s\b"), "a measured rate"),
    (re.compile(rf"\b{NUMBER}\s?[kKMx%]?\s?->\s?~?{NUMBER}"), "a before -> after figure"),
    (re.compile(rf"\b{NUMBER}.*\b(cheaper|faster|slower)\b|\b(cheaper|faster|slower)\b.*\b{NUMBER}",
                re.IGNORECASE), "a speed claim with a figure"),
    (re.compile(rf"\b(took|against|vs\.?)\s~?{NUMBER}\s?(s|ms|min|seconds)\b|\bs of CPU\b"),
     "a measured duration"),
]
OUTSIDE = [
    (re.compile(r"/work/|\.\./shared|\bbench-peers\b"), "a path outside the repository"),
    (re.compile(r"(?<![\w/.-])(DESIGN|STYLE|LESSONS)\.md\b"),
     "a document outside the repository (link docs/)"),
]


def checked_files() -> list[Path]:
    """Every module of the package."""
    return sorted(PACKAGE.rglob("*.py"))


def script_files() -> list[Path]:
    """The benchmark and example scripts (checked for outside paths only)."""
    return sorted([*(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "examples").rglob("*.py")])


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of ``source``."""
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            out.append((node.lineno, node.value.value))
    return out


def diaries(source: str, patterns: list[tuple[re.Pattern[str], str]] | None = None) -> list[str]:
    """``line: what: text`` of each comment or docstring line that reads as a diary
    (``patterns``: all of them by default)."""
    found = []
    for line, text in prose(source):
        for offset, part in enumerate(text.splitlines()):
            for pattern, what in (DIARY + OUTSIDE if patterns is None else patterns):
                if pattern.search(part):
                    found.append(f"{line + offset}: {what}: {part.strip()}")
    return found


@pytest.mark.parametrize("text", [
    "# positional: ~0.2 us cheaper",
    "# it waited: ~25 us a chunk, 2.8 -> ~4.2M steps/s ingested",
    '"""Faster by 30% than the old path."""',
    "# see /work/shared/DESIGN.md",
    "# as LESSONS.md 12 says",
    "# 1.2M steps/s on the dev machine",
    "# page faults on its own: reading 2 GB into it took 0.87 s of CPU, against 0.19 s with",
    "# the peers as in ../shared/bench-peers/common.py",
    '"""The peer harness in ``bench-peers/`` has no warm-up."""',
    "# the window rule of DESIGN.md",
])
def test_diaries_are_found(text: str) -> None:
    assert diaries(text + "\n")


@pytest.mark.parametrize("text", [
    "# a writer stores head after its record's bytes (total store order)",
    '"""Waits up to ``timeout_s`` (0.5 s by default) for the lock."""',
    "# rows 0, 1: chunk 2's 4 steps, then chunk 1's",
    "x = '2.8 -> 4.2M steps/s'  # a string, not prose",
    "# see docs/semantics.md for the window rule",
    '"""Waits 10 s at most, then raises."""',
])
def test_invariants_pass(text: str) -> None:
    assert diaries(text + "\n") == []


def test_a_planted_diary_in_a_module_is_reported() -> None:
    module = '"""A module."""\n\nX = 1  # writes ~0.3 us cheaper than a loop (see /work/notes)\n'
    found = diaries(module)
    assert {d.split(":")[0] for d in found} == {"3"}, found
    assert {"an approximate timing", "a path outside the repository"} <= {d.split(": ")[1] for d in found}


def test_no_timing_diaries_in_the_package() -> None:
    files = checked_files()
    assert len(files) > 100, "the package moved?"
    bad = [f"{p.relative_to(PACKAGE)}:{d}" for p in files for d in diaries(p.read_text())]
    assert not bad, "timing diaries in comments (figures go to benchmarks/*/RESULTS*.md):\n" + "\n".join(bad)


def test_no_outside_paths_in_benchmarks_and_examples() -> None:
    files = script_files()
    assert len(files) > 10, "the scripts moved?"
    bad = [f"{p.relative_to(ROOT)}:{d}" for p in files for d in diaries(p.read_text(), OUTSIDE)]
    assert not bad, "paths or documents outside the repository:\n" + "\n".join(bad)
