"""The developer habits hold: CI lints and type-checks before the tests, the Makefile has
the targets the README names, mypy is pinned and configured, and the package ships
``py.typed``.
"""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_ci_runs_lint_then_typecheck_then_test() -> None:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    makes = [line.strip() for line in lines if line.strip().startswith("make")]
    assert makes == ["make lint", "make typecheck", "make test"]


def test_makefile_has_the_targets_the_readme_names() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.MULTILINE))
    assert {"test", "test-fast", "lint", "typecheck"} <= targets
    fast = re.search(r"^test-fast:.*?\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert fast is not None and '-m "not slow"' in fast.group(1)
    readme = (ROOT / "README.md").read_text()
    for name in ("make test-fast", "make lint", "make typecheck"):
        assert name in readme, f"README's developer section should name {name}"


def test_mypy_is_pinned_in_the_test_extra() -> None:
    pins = [d for d in PYPROJECT["project"]["optional-dependencies"]["test"] if d.startswith("mypy")]
    assert len(pins) == 1 and re.fullmatch(r"mypy==[\d.]+", pins[0]), pins


def test_mypy_ignores_missing_imports_only_for_untyped_modules() -> None:
    mypy = PYPROJECT["tool"]["mypy"]
    assert mypy["python_version"] == "3.11" and mypy["packages"] == ["shardreplay"]
    assert "ignore_missing_imports" not in mypy, "list the untyped modules by name instead"
    for override in mypy.get("overrides", []):
        assert override.get("ignore_missing_imports") is True
        for module in override["module"]:
            top = module.split(".")[0]
            spec = importlib.util.find_spec(top)
            if spec is None or spec.origin is None:
                continue  # not installed here; mypy would not check it either
            marker = Path(spec.origin).parent / "py.typed"
            assert not marker.exists(), f"{top} ships py.typed: drop it from the override"


def test_package_ships_py_typed() -> None:
    assert (ROOT / "src" / "shardreplay" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["shardreplay"]
