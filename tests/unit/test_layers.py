"""The package's import layers: nothing imports upwards, no two folders import each other.

Every module of ``kvoffload_hal/`` and ``backends/`` (installed as
``kvoffload_hal.backends``) is parsed, and every import of the package is read:
at module level, inside functions and methods, and under ``if TYPE_CHECKING:``.
Type-only imports count: a type named in a signature is a dependency of the
module's contract, and an upward one would need a cycle at the next refactor.
Plug-in targets named in strings (``"pkg.module:Class"`` in a registry) are not
imports: they are looked up by name, at run time, by the registries.

The rules (``docs/design.md``, "Layers"):

1. Each top-level module or folder belongs to one layer of :data:`LAYERS`; it
   imports its own folder and lower layers only. Two folders of one layer do
   not import each other (the scheduler and the worker, the tiers and the
   eviction policies, ...).
2. Inside a folder, a subfolder and its siblings do not import each other both
   ways (``scheduler/secondary/`` uses ``scheduler/cpu_tier.py``; nothing it uses
   imports ``scheduler/secondary/`` back). Modules of one folder may refer to
   each other's types: the folder is the unit of the rules.
3. The settings and the capabilities use a plug-in family through its contract
   and registry only, never an implementation (``config.py`` validates an
   eviction policy's or a tier's name without importing it).
4. Every import of the package names a module that exists.
"""

from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "kvoffload_hal"

# Bottom to top: a module imports its own folder and the layers below it.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("base", frozenset({"__init__", "logger", "config_values", "plugins", "vllm_compat",
                       "host_memory"})),
    ("copy contract", frozenset({"hal"})),
    ("plug-in families", frozenset({"tiers", "eviction", "backends"})),
    ("messages and settings", frozenset({"metadata", "metrics", "config"})),
    ("capabilities", frozenset({"capabilities"})),
    ("sides", frozenset({"scheduler", "worker", "exit_flush"})),
    ("facade", frozenset({"connector", "plugin", "selfcheck", "demo"})),
)
# What rule 3 lets the settings and the capabilities use of a plug-in family.
CONTRACTS = frozenset({
    "kvoffload_hal.hal", "kvoffload_hal.hal.backend", "kvoffload_hal.hal.registry",
    "kvoffload_hal.tiers.spec", "kvoffload_hal.tiers.registry",
    "kvoffload_hal.eviction.base", "kvoffload_hal.eviction.registry",
})
CONTRACT_USERS = ("messages and settings", "capabilities")


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    imported: str  # the module it resolves to
    where: str  # file:line
    how: str  # "", " (in a function)", " (type only)"

    def __str__(self) -> str:
        return f"{self.where}{self.how}: {self.importer} imports {self.imported}"


def module_files(roots: dict[str, Path]) -> dict[str, Path]:
    """``module name -> file`` for every ``.py`` under each ``prefix -> folder``."""
    found = {}
    for prefix, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


class _Reader(ast.NodeVisitor):
    """Collects ``(module named, line, how)`` of every import in one file."""

    def __init__(self, package: str) -> None:
        self.package = package  # the module's own package, for relative imports
        self.found: list[tuple[str, list[str], int, str]] = []
        self._how: list[str] = []

    def _inside(self, node: ast.AST, how: str) -> None:
        self._how.append(how)
        self.generic_visit(node)
        self._how.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._inside(node, " (in a function)")

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
        if name == "TYPE_CHECKING":
            self._inside(node, " (type only)")
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, [], node.lineno, self._how_now()))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level:
            base = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            module = ".".join(base + ([module] if module else []))
        self.found.append((module, [a.name for a in node.names], node.lineno, self._how_now()))

    def _how_now(self) -> str:
        return self._how[-1] if self._how else ""


def read_imports(files: dict[str, Path], root: Path) -> tuple[list[Import], list[str]]:
    """Every import of the package between ``files``, and the names that match no module."""
    imports, missing = [], []
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        reader = _Reader(package)
        reader.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        where = path.relative_to(root).as_posix()
        for module, names, line, how in reader.found:
            if module != PACKAGE and not module.startswith(PACKAGE + "."):
                continue
            targets = {f"{module}.{n}" if f"{module}.{n}" in files else module for n in names}
            for target in targets or {module}:
                if target in files:
                    imports.append(Import(name, target, f"{where}:{line}", how))
                else:
                    missing.append(f"{where}:{line}: {target}")
    return imports, missing


def _child(module: str, package: str) -> str:
    """The child of ``package`` that holds ``module`` (``__init__`` for the package)."""
    if module == package:
        return "__init__"
    return module[len(package) + 1:].split(".")[0]


def layer_violations(imports: list[Import]) -> list[str]:
    """Rule 1, and the units no layer names."""
    layer_of = {unit: i for i, (_, units) in enumerate(LAYERS) for unit in units}
    found = []
    for imp in imports:
        a, b = _child(imp.importer, PACKAGE), _child(imp.imported, PACKAGE)
        for unit in (a, b):
            if unit not in layer_of:
                found.append(f"{imp}: '{unit}' is in no layer (add it to LAYERS)")
        if a == b or a not in layer_of or b not in layer_of:
            continue
        if layer_of[b] >= layer_of[a]:
            up = "a higher layer" if layer_of[b] > layer_of[a] else "another folder of its layer"
            found.append(f"{imp}: {LAYERS[layer_of[a]][0]} '{a}' imports {up}, "
                         f"{LAYERS[layer_of[b]][0]} '{b}'")
    return found


def folder_cycles(imports: list[Import], packages: set[str]) -> list[str]:
    """Rule 2: in each package, cycles between its children that go through a subfolder."""
    found = []
    for package in sorted(packages):
        edges: dict[str, dict[str, Import]] = {}
        for imp in imports:
            inside = (imp.importer.startswith(package + ".")
                      and imp.imported.startswith(package + "."))
            a, b = _child(imp.importer, package), _child(imp.imported, package)
            if inside and a != b:
                edges.setdefault(a, {}).setdefault(b, imp)
        for cycle in _cycles(edges):
            if any(f"{package}.{unit}" in packages for unit in cycle):
                why = [str(edges[a][b]) for a in sorted(cycle) for b in sorted(edges.get(a, {}))
                       if b in cycle]
                found.append(f"{package}: {' <-> '.join(sorted(cycle))} import each other:\n  "
                             + "\n  ".join(why))
    return found


def _cycles(edges: dict[str, dict[str, Import]]) -> list[frozenset[str]]:
    """The strongly connected groups of more than one node."""
    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), {}):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reach = {node: reachable(node) for node in edges}
    groups = {frozenset({n} | {m for m in reach[n] if n in reach.get(m, ())}) for n in edges}
    return sorted((g for g in groups if len(g) > 1), key=sorted)


def implementations_used(imports: list[Import]) -> list[str]:
    """Rule 3."""
    users = {unit for name, units in LAYERS if name in CONTRACT_USERS for unit in units}
    families = next(units for name, units in LAYERS if name == "plug-in families")
    return [f"{imp}: use the family's contract or registry ({', '.join(sorted(CONTRACTS))})"
            for imp in imports
            if _child(imp.importer, PACKAGE) in users
            and _child(imp.imported, PACKAGE) in families and imp.imported not in CONTRACTS]


def check(roots: dict[str, Path], root: Path) -> list[str]:
    """Every rule's violations in the modules under ``roots``."""
    files = module_files(roots)
    imports, missing = read_imports(files, root)
    packages = {name for name, path in files.items() if path.name == "__init__.py"}
    return ([f"{m}: no such module" for m in missing] + layer_violations(imports)
            + folder_cycles(imports, packages) + implementations_used(imports))


SOURCES = {PACKAGE: ROOT / "kvoffload_hal", f"{PACKAGE}.backends": ROOT / "backends"}


def test_the_package_keeps_its_layers():
    problems = check(SOURCES, ROOT)
    assert not problems, "\n".join(problems)


def test_every_import_is_read():
    """Lazy and type-only imports are seen, and every folder is in a layer."""
    files = module_files(SOURCES)
    imports, _ = read_imports(files, ROOT)
    edges = {(i.importer, i.imported, i.how) for i in imports}
    assert ("kvoffload_hal.metrics", "kvoffload_hal.tiers.registry", " (in a function)") in edges
    assert ("kvoffload_hal.worker.loads", "kvoffload_hal.capabilities", " (type only)") in edges
    assert ("kvoffload_hal.backends.cuda.backend", "kvoffload_hal.hal.threaded", "") in edges
    units = {_child(name, PACKAGE) for name in files}
    assert units == {unit for _, layer in LAYERS for unit in layer}


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_check_finds_upward_imports_lazy_or_type_only(tmp_path):
    _write(tmp_path, {
        "kvoffload_hal/__init__.py": "",
        "kvoffload_hal/logger.py": "",
        "kvoffload_hal/config.py": "from kvoffload_hal import logger\n",
        "kvoffload_hal/scheduler/__init__.py": "",
        "kvoffload_hal/worker/__init__.py": "from kvoffload_hal.scheduler import core\n",
        "kvoffload_hal/scheduler/core.py": "",
        "kvoffload_hal/tiers/__init__.py": "",
        "kvoffload_hal/tiers/spec.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from kvoffload_hal.scheduler.core import X\n"
            "def f():\n    from ..config import Y\n"),
    })
    problems = check({PACKAGE: tmp_path / "kvoffload_hal"}, tmp_path)
    assert problems == [
        "kvoffload_hal/tiers/spec.py:3 (type only): kvoffload_hal.tiers.spec imports "
        "kvoffload_hal.scheduler.core: plug-in families 'tiers' imports a higher layer, "
        "sides 'scheduler'",
        "kvoffload_hal/tiers/spec.py:5 (in a function): kvoffload_hal.tiers.spec imports "
        "kvoffload_hal.config: plug-in families 'tiers' imports a higher layer, "
        "messages and settings 'config'",
        "kvoffload_hal/worker/__init__.py:1: kvoffload_hal.worker imports "
        "kvoffload_hal.scheduler.core: sides 'worker' imports another folder of its layer, "
        "sides 'scheduler'",
    ]


def test_the_check_finds_a_subfolder_cycle_and_a_missing_module(tmp_path):
    _write(tmp_path, {
        "kvoffload_hal/__init__.py": "",
        "kvoffload_hal/scheduler/__init__.py": "",
        "kvoffload_hal/scheduler/cpu_tier.py": "import kvoffload_hal.scheduler.secondary.index\n",
        "kvoffload_hal/scheduler/jobs.py": "import kvoffload_hal.scheduler.cpu_tier\n",
        "kvoffload_hal/scheduler/core.py": "from kvoffload_hal.scheduler import jobs\n",
        "kvoffload_hal/scheduler/secondary/__init__.py": "",
        "kvoffload_hal/scheduler/secondary/index.py": (
            "from kvoffload_hal.scheduler.jobs import X\n"
            "from kvoffload_hal.scheduler.staged import Y\n"),
    })
    problems = check({PACKAGE: tmp_path / "kvoffload_hal"}, tmp_path)
    assert problems == [
        "kvoffload_hal/scheduler/secondary/index.py:2: kvoffload_hal.scheduler.staged: "
        "no such module",
        "kvoffload_hal.scheduler: cpu_tier <-> jobs <-> secondary import each other:\n"
        "  kvoffload_hal/scheduler/cpu_tier.py:1: kvoffload_hal.scheduler.cpu_tier "
        "imports kvoffload_hal.scheduler.secondary.index\n"
        "  kvoffload_hal/scheduler/jobs.py:1: kvoffload_hal.scheduler.jobs "
        "imports kvoffload_hal.scheduler.cpu_tier\n"
        "  kvoffload_hal/scheduler/secondary/index.py:1: kvoffload_hal.scheduler.secondary.index "
        "imports kvoffload_hal.scheduler.jobs",
    ]


@pytest.mark.parametrize("file, line, expected", [
    ("tiers/spec.py", "    from kvoffload_hal.scheduler.cpu_tier import CpuTier\n",
     "plug-in families 'tiers' imports a higher layer, sides 'scheduler'"),
    ("scheduler/cpu_tier.py", "    from kvoffload_hal.scheduler.secondary.index import TierIndex\n",
     "<-> secondary import each other"),
    ("config.py", "    from kvoffload_hal.eviction.adaptive import AdaptiveEviction\n",
     "use the family's contract or registry"),
    ("eviction/base.py", "    from kvoffload_hal.tiers.spec import BlockKey\n",
     "another folder of its layer"),
])
def test_one_bad_import_in_a_copy_of_the_package_is_found(tmp_path, file, line, expected):
    copy = tmp_path / "kvoffload_hal"
    shutil.copytree(ROOT / "kvoffload_hal", copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / file, "a") as f:
        f.write(f"\n\nif TYPE_CHECKING:\n{line}")
    injected = f"kvoffload_hal/{file}:{len((copy / file).read_text().splitlines())}"
    problems = check({PACKAGE: copy}, tmp_path)
    assert any(expected in p for p in problems), problems
    assert all(injected in p for p in problems), problems  # that line, and nothing else
