"""The package stays readable: files, functions and classes of bounded length, and
one place that knows which vLLM release runs.

Files under 400 lines, functions under 60, classes under 250, in
``kvoffload_hal/`` and ``backends/``; split by job when one grows past that.

What the connector does differently on older vLLM is decided by the strategy that
``capabilities.py`` holds and picks, from the flags of ``vllm_compat.py``; everywhere
else calls the strategy's methods. A *version
branch* is, in the code (the syntax tree: not in docstrings or comments):

* a member of ``LoadRecovery`` (``LoadRecovery.RETRY``, ...);
* any ``.load_recovery`` (``caps.load_recovery``, ``caps.vllm.load_recovery``);
* a behaviour flag of ``vllm_compat`` (:data:`BEHAVIOUR_FLAGS`), read as
  ``vllm_compat.<flag>`` or imported by name from it.

The helpers of ``vllm_compat`` that smooth over an API's shape (``iter_free_blocks``,
``make_coordinator``, ...) are no branch: they do the same thing on every release.
``caps.sync_loads`` is none either: it is ``load_mode`` resolved with the backend and
the model, alike on every release.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMITS = {"file": 400, "function": 60, "class": 250}

BEHAVIOUR_FLAGS = frozenset({
    "HAS_TRANSFER_RESULTS", "REPORTS_FAILED_RECVING", "STEPS_FOR_PUSH_WORK",
    "SLEEP_WITH_CONNECTORS", "HOST_HIT_SOURCE", "block_holders_first", "failed_recving",
})
# Where the release is known: the flags, and the strategy where it is chosen.
VERSION_AWARE = frozenset({"kvoffload_hal/vllm_compat.py", "kvoffload_hal/capabilities.py"})


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


def version_branches(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line: what`` for each version branch of ``path`` (see the module docstring)."""
    where = path.relative_to(root).as_posix()
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        what = None
        if isinstance(node, ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner == "LoadRecovery" or node.attr == "load_recovery":
                what = ast.unparse(node)
            elif owner == "vllm_compat" and node.attr in BEHAVIOUR_FLAGS:
                what = ast.unparse(node)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("vllm_compat"):
            flags = sorted(a.name for a in node.names if a.name in BEHAVIOUR_FLAGS)
            what = f"from {node.module} import {', '.join(flags)}" if flags else None
        if what is not None:
            found.append(f"{where}:{node.lineno}: {what}")
    return found


def test_the_version_branch_finder_sees_each_kind(tmp_path):
    sample = tmp_path / "kvoffload_hal" / "sample.py"
    sample.parent.mkdir()
    sample.write_text(
        '"""vllm_compat.STEPS_FOR_PUSH_WORK in a docstring is no branch."""\n'
        "from kvoffload_hal.vllm_compat import HOST_HIT_SOURCE, iter_free_blocks\n"
        "a = caps.load_recovery is LoadRecovery.RETRY\n"
        "b = vllm_compat.block_holders_first() or vllm_compat.iter_free_blocks(q)\n"
        "c = caps.sync_loads and caps.vllm.tracks_landed_loads()\n")
    assert sorted(version_branches(sample, tmp_path)) == [
        "kvoffload_hal/sample.py:2: from kvoffload_hal.vllm_compat import HOST_HIT_SOURCE",
        "kvoffload_hal/sample.py:3: LoadRecovery.RETRY",
        "kvoffload_hal/sample.py:3: caps.load_recovery",
        "kvoffload_hal/sample.py:4: vllm_compat.block_holders_first",
    ]


def test_no_version_branch_outside_the_strategy():
    found = [b for p in sorted((ROOT / "kvoffload_hal").rglob("*.py"))
             if p.relative_to(ROOT).as_posix() not in VERSION_AWARE
             for b in version_branches(p)]
    assert not found, ("a vLLM-version branch outside capabilities.py (call a method of "
                       "caps.vllm instead):\n" + "\n".join(found))

