"""The package stays readable: files, functions and classes of bounded length.

Files under 400 lines, functions under 60, classes under 250, in
``kvoffload_hal/`` and ``backends/``; split by job when one grows past that.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMITS = {"file": 400, "function": 60, "class": 250}


def _sources():
    for folder in ("kvoffload_hal", "backends"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def _too_long(path: Path) -> list[tuple[str, str]]:
    """``(kind, what)`` for each file, function or class of ``path`` over its limit."""
    source = path.read_text(encoding="utf-8")
    where = path.relative_to(ROOT)
    found = []
    if len(source.splitlines()) > LIMITS["file"]:
        found.append(("file", f"{where}: {len(source.splitlines())} lines"))
    for node in ast.walk(ast.parse(source)):
        kind = ("function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                else "class" if isinstance(node, ast.ClassDef) else None)
        if kind is None:
            continue
        length = node.end_lineno - node.lineno + 1
        if length > LIMITS[kind]:
            found.append((kind, f"{where}:{node.lineno}: {kind} {node.name}, {length} lines"))
    return found


def test_the_sources_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in _sources()}
    assert {"kvoffload_hal/connector.py", "backends/cuda/backend.py"} <= names


@pytest.mark.parametrize("limit", sorted(LIMITS))
def test_nothing_is_longer_than_its_limit(limit):
    too_long = [what for p in _sources() for kind, what in _too_long(p) if kind == limit]
    assert not too_long, f"over the {limit} limit of {LIMITS[limit]} lines:\n" + "\n".join(too_long)
