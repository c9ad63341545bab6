"""Package-level contracts: the public names, a light import, and the layer order."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import shardreplay

PACKAGE_DIR = Path(shardreplay.__file__).resolve().parent

# Layers import downwards only (the layering README.md lists): a module may import shardreplay
# modules of its own layer or of lower layers. transport and policy need only spec, but they
# sit above distributed/checkpoint so that runtime can compose all of them.
LAYERS: dict[str, int] = {
    "kernels": -1,  # the lowest layer: numpy, numba and the stdlib only (see below)
    "errors": 0,
    "spec": 0,
    "_io": 0,
    "_hashing": 0,
    "_lazy": 0,
    "_signals": 0,  # the one module that installs signal handlers
    "secrets": 0,  # Redis passwords: light (os, urllib), used from transport up
    "storage": 1,
    "samplers": 2,
    "buffer": 3,
    "distributed": 4,
    "checkpoint": 4,
    "gym": 4,  # gymnasium adapters over the buffer (numpy only: gymnasium is read lazily)
    "testing": 4,
    "transport": 5,
    "policy": 5,
    "offline": 5,  # Minari export/import: over checkpoint and the sharded buffer, under runtime
    "runtime": 6,
    "cli": 7,
    "__main__": 7,
}

# Arrows the layer order allows but the design forbids: the sharded buffer and checkpoints
# reach storage and samplers only through the buffer's internal Shard (buffer/shard.py).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "distributed": ("storage", "samplers"),
    "checkpoint": ("storage", "samplers"),
}

# Imported by `import shardreplay` only on demand (optional extras, slow imports).
HEAVY_OPTIONAL = ("redis", "gymnasium", "matplotlib", "rich", "minari")


def test_all_is_sorted_and_every_name_exists() -> None:
    names = shardreplay.__all__
    assert names == sorted(names), "keep shardreplay.__all__ sorted"
    assert len(names) == len(set(names)), "shardreplay.__all__ has duplicates"
    missing = [n for n in names if not hasattr(shardreplay, n)]
    assert not missing, f"names in __all__ that shardreplay does not define: {missing}"


def test_import_is_light() -> None:
    code = (
        "import json, sys\n"
        "import shardreplay\n"
        f"print(json.dumps([m for m in {HEAVY_OPTIONAL!r} if m in sys.modules]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == [], f"`import shardreplay` imported optional heavy modules: {loaded}"


def _module_name(path: Path, package_dir: Path) -> str:
    rel = path.relative_to(package_dir.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported_modules(path: Path, package_dir: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every shardreplay import in a file, lazy ones too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    this = _module_name(path, package_dir)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "shardreplay" or (node.level and not node.module):
                # `from shardreplay import x` / `from . import x`: x may be a submodule.
                found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, target))
    return [(line, m) for line, m in found if m == "shardreplay" or m.startswith("shardreplay.")]


def _layer_name(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_problems(package_dir: Path) -> list[str]:
    """Every import in the package at ``package_dir`` that breaks the layer order."""
    problems: list[str] = []
    for path in sorted(package_dir.rglob("*.py")):
        own = _layer_name(_module_name(path, package_dir))
        if own is None:  # the package root is the facade: it may import anything
            continue
        where = path.relative_to(package_dir.parent)
        if own not in LAYERS:
            problems.append(f"{where}: top-level module {own!r} has no layer; add it to LAYERS")
            continue
        for line, target in _imported_modules(path, package_dir):
            dep = _layer_name(target)
            if dep is None or dep in shardreplay.__all__:
                problems.append(
                    f"{where}:{line}: imports from the package root ({target}); "
                    "import from the defining subpackage instead"
                )
            elif dep not in LAYERS:
                problems.append(f"{where}:{line}: imports {target}, whose layer is unknown")
            elif dep in FORBIDDEN.get(own, ()):
                problems.append(
                    f"{where}:{line}: {own} imports {target}: {own} reaches {dep} only "
                    "through the buffer's Shard (buffer/shard.py)"
                )
            elif LAYERS[dep] > LAYERS[own]:
                problems.append(
                    f"{where}:{line}: {own} (layer {LAYERS[own]}) imports {target} "
                    f"(layer {LAYERS[dep]}): layers import downwards only"
                )
    return problems


# Attributes of the Shard's insides that only buffer/ may read (the attribute twin of
# FORBIDDEN): elsewhere ``x.storage``, ``x.sampler`` and ``x._one_step`` are reach-ins,
# unless ``x`` is ``self`` (a sampler's own storage, a learner's storage guard).
SHARD_INSIDES = ("storage", "sampler", "_one_step", "_storage", "_sampler")


def reach_in_problems(package_dir: Path) -> list[str]:
    """Every read of a Shard's storage, sampler or one-step writer outside buffer/."""
    problems: list[str] = []
    for path in sorted(package_dir.rglob("*.py")):
        if _layer_name(_module_name(path, package_dir)) == "buffer":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in SHARD_INSIDES
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                problems.append(f"{path.relative_to(package_dir.parent)}:{node.lineno}: reads "
                                f".{node.attr} of {ast.unparse(node.value)}: reach a buffer's storage "
                                "and sampler only through the Shard's methods (buffer/shard.py)")
    return problems


def test_nothing_outside_buffer_reaches_into_a_shard() -> None:
    problems = reach_in_problems(PACKAGE_DIR)
    assert not problems, "\n".join(problems)


def test_reach_in_check_catches_attribute_reads(tmp_path: Path) -> None:
    pkg = tmp_path / "shardreplay"
    files = {
        "gym/writer.py": "def f(shard):\n    return shard.storage.records, shard._one_step\n",
        "checkpoint/x.py": "def g(self):\n    return self._shard.sampler.name\n",
        "samplers/own.py": "class S:\n    def f(self):\n        return self.storage.valid\n",  # its own
        "buffer/shard.py": "def h(shard):\n    return shard._storage\n",  # inside buffer/: fine
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    problems = reach_in_problems(pkg)
    assert len(problems) == 3, problems
    for text in ("gym/writer.py:2: reads .storage of shard", "gym/writer.py:2: reads ._one_step of shard",
                 "checkpoint/x.py:2: reads .sampler of self._shard"):
        assert any(text in p for p in problems), (text, problems)


def test_contributing_draws_the_layers_as_listed_here() -> None:
    """CONTRIBUTING.md's drawing ``a -> b/c -> ...`` names every public layer of LAYERS
    once, each group one layer, in increasing order."""
    text = (Path(__file__).resolve().parents[1] / "CONTRIBUTING.md").read_text()
    start = text.index("Layers import downwards only")
    drawing = text[text.index(":", start) + 1:text.index(".\n", start)]
    groups = [[n.strip().strip("`") for n in g.split("/")] for g in drawing.split("->")]
    assert [sorted({LAYERS[n] for n in g}) for g in groups] == [[LAYERS[g[0]]] for g in groups], groups
    levels = [LAYERS[g[0]] for g in groups]
    assert levels == sorted(set(levels)), groups
    public = {n for n in LAYERS if not n.startswith("_") or n == "__main__"}
    assert sorted(n for g in groups for n in g) == sorted(public)


def test_only_one_module_installs_signal_handlers() -> None:
    """Handlers are installed through ``shardreplay._signals.install`` alone."""
    package_dir = Path(shardreplay.__file__).parent
    calls = [str(path.relative_to(package_dir)) for path in sorted(package_dir.rglob("*.py"))
             if path.name != "_signals.py" and ("signal.signal(" in path.read_text()
                                                 or "signal.getsignal(" in path.read_text())]
    assert calls == []


def test_layers_import_downwards_only() -> None:
    assert list(PACKAGE_DIR.rglob("*.py")), "no sources found"
    problems = layer_problems(PACKAGE_DIR)
    assert not problems, "\n".join(problems)


def test_kernels_import_only_numpy_numba_and_the_stdlib() -> None:
    allowed = {"numpy", "numba", "llvmlite", "shardreplay", "__future__"} | set(sys.stdlib_module_names)
    found = []
    for path in sorted((PACKAGE_DIR / "kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] not in allowed]
    assert not found, found


def test_layer_check_catches_upward_and_root_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "shardreplay"
    files = {
        "__init__.py": "from shardreplay.cli import main\n",
        "storage/__init__.py": "",
        "storage/ram.py": (
            "from shardreplay.spec import Spec\n"  # downwards: fine
            "from ..errors import ConfigError\n"  # relative, downwards: fine
            "from . import ring\n"  # same layer: fine
            "def f():\n    from ..buffer import replay_buffer\n"  # lazy and upwards
        ),
        "storage/ring.py": "from shardreplay import Spec\n",  # the package root
        "cli/__init__.py": "import shardreplay.runtime.actor\nimport shardreplay.nowhere\n",
        "oddball.py": "",
        "checkpoint/__init__.py": "from shardreplay.storage import STEP_ARRAYS\n",  # forbidden
        "distributed/x.py": "from shardreplay.buffer.shard import Shard\n",  # through the Shard: fine
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    problems = layer_problems(pkg)
    assert len(problems) == 5, problems
    expected = [
        "storage/ram.py:5: storage (layer 1) imports shardreplay.buffer (layer 3)",
        "storage/ring.py:1: imports from the package root (shardreplay.Spec)",
        "cli/__init__.py:2: imports shardreplay.nowhere, whose layer is unknown",
        "shardreplay/oddball.py: top-level module 'oddball' has no layer",
        "checkpoint/__init__.py:1: checkpoint imports shardreplay.storage: checkpoint reaches storage only",
    ]
    for text in expected:
        assert any(text in p for p in problems), (text, problems)


@pytest.mark.slow  # fresh interpreters or many examples: 20-100 s at load ~9 on 2 cores
def test_the_command_starts_without_torch() -> None:
    """`shardreplay` takes Ctrl-C and SIGTERM over (cli.main) before torch and numba are
    imported, which takes seconds: the package root and the command's entry must not
    import them (issue 19, item 4). The public names still load on first use."""
    code = (
        "import json, sys\n"
        "import shardreplay, shardreplay.cli.main, shardreplay._signals\n"
        "before = [m for m in ('torch', 'numba', 'numpy') if m in sys.modules]\n"
        "shardreplay.ReplayBuffer\n"
        "print(json.dumps([before, 'torch' in sys.modules]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    before, loaded_on_use = json.loads(proc.stdout.strip().splitlines()[-1])
    assert before == [], f"the command's entry imported {before} before taking the signals over"
    assert loaded_on_use


def test_the_package_root_imports_nothing_from_runtime_or_cli() -> None:
    """The library's public names live below the runtime: ``shardreplay/__init__`` maps
    none of them to (and imports none from) runtime or cli (issue 20: GymStepConverter
    came from runtime.gym_steps; it lives in shardreplay.gym now)."""
    root = PACKAGE_DIR / "__init__.py"
    homes = {name: module for name, module in shardreplay._HOMES.items()
             if LAYERS.get(_layer_name(module) or "", 0) >= LAYERS["runtime"]}
    assert not homes, f"public names homed in runtime/cli: {homes}"
    imported = [m for _, m in _imported_modules(root, PACKAGE_DIR)
                if LAYERS.get(_layer_name(m) or "", 0) >= LAYERS["runtime"]]
    assert not imported, f"shardreplay/__init__.py imports from runtime/cli: {imported}"
