"""The wheel built from the checkout, installed without the checkout on the path.

An editable install sees every file of the tree, so it cannot tell whether
``setup.py`` ships them: a hand-written package list once left
``kvoffload_hal.selfcheck`` out of the wheel. Here the wheel is built, installed
into a scratch environment, and used from a directory outside the tree.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.wheel_install import build_wheel, install_wheel, make_scratch_env, run_python

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Folders of the tree and where setup.py puts them in the wheel (package_dir).
SHIPPED_TREES = {"kvoffload_hal": "kvoffload_hal", "backends": "kvoffload_hal/backends"}

_WHERE = """
import json, sys
import kvoffload_hal, kvoffload_hal.backends
print(json.dumps({"package": kvoffload_hal.__file__,
                  "backends": kvoffload_hal.backends.__file__,
                  "meta_path": [repr(f) for f in sys.meta_path]}))
"""


@dataclass(frozen=True)
class Installed:
    wheel: Path
    names: frozenset[str]
    python: Path
    env_dir: Path
    outside: Path  # the working directory of every scratch run: outside the tree


def _check_isolated(python: Path, env_dir: Path, outside: Path) -> None:
    proc = run_python(python, ["-c", _WHERE], outside)
    assert proc.returncode == 0, f"the installed wheel does not import:\n{proc.stderr}"
    where = json.loads(proc.stdout)
    for key in ("package", "backends"):
        path = Path(where[key]).resolve()
        if not path.is_relative_to(env_dir.resolve()) or path.is_relative_to(REPO_ROOT):
            pytest.fail(f"the scratch environment is not isolated: kvoffload_hal "
                        f"({key}) was imported from {path}, not from the installed wheel "
                        f"under {env_dir}")
    finders = [f for f in where["meta_path"] if "editable" in f.lower()]
    assert not finders, f"an editable finder is active in the scratch environment: {finders}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    work = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(REPO_ROOT, work)
    with zipfile.ZipFile(wheel) as zf:
        names = frozenset(zf.namelist())
    env_dir = work / "venv"
    python = make_scratch_env(env_dir)
    install_wheel(python, wheel)
    outside = work / "cwd"
    outside.mkdir()
    _check_isolated(python, env_dir, outside)
    return Installed(wheel, names, python, env_dir, outside)


def _tree_modules() -> list[str]:
    """Every ``*.py`` of the shipped folders, named as its path in the wheel."""
    modules = []
    for folder, target in SHIPPED_TREES.items():
        root = REPO_ROOT / folder
        for path in root.rglob("*.py"):
            if "__pycache__" not in path.parts:
                modules.append(f"{target}/{path.relative_to(root).as_posix()}")
    return sorted(modules)


def test_every_module_of_the_tree_is_in_the_wheel(installed):
    modules = _tree_modules()
    assert "kvoffload_hal/selfcheck/__main__.py" in modules  # the walk itself found them
    assert "kvoffload_hal/backends/cpu/backend.py" in modules
    missing = [m for m in modules if m not in installed.names]
    assert not missing, (f"{len(missing)} of {len(modules)} modules of the tree are not in "
                         f"{installed.wheel.name}: {missing}")


def test_wheel_holds_the_hostcopy_extension(installed):
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler (gcc/cc): setup.py builds the optional _hostcopy without it")
    extensions = [n for n in installed.names
                  if n.startswith("kvoffload_hal/backends/cpu/_hostcopy") and n.endswith(".so")]
    assert extensions, f"no kvoffload_hal/backends/cpu/_hostcopy*.so in {installed.wheel.name}"
    proc = run_python(installed.python, ["-c", "import kvoffload_hal.backends.cpu._hostcopy as m;"
                                               " print(m.__file__)"], installed.outside)
    assert proc.returncode == 0, f"the wheel's _hostcopy does not import:\n{proc.stderr}"
    assert Path(proc.stdout.strip()).resolve().is_relative_to(installed.env_dir.resolve())


def test_connector_imports_from_the_wheel(installed):
    code = ("from kvoffload_hal.connector import HALOffloadConnector; "
            "import inspect; print(inspect.getfile(HALOffloadConnector))")
    proc = run_python(installed.python, ["-c", code], installed.outside)
    assert proc.returncode == 0, f"HALOffloadConnector does not import:\n{proc.stderr[-4000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"nothing printed; stderr:\n{proc.stderr[-4000:]}"
    assert Path(lines[-1]).resolve().is_relative_to(installed.env_dir.resolve())


def test_selfcheck_runs_from_the_wheel(installed):
    proc = run_python(installed.python, ["-m", "kvoffload_hal.selfcheck", "--backend", "cpu",
                                         "--json"], installed.outside)
    assert proc.returncode == 0, (f"python -m kvoffload_hal.selfcheck exited "
                                  f"{proc.returncode}:\n{proc.stdout[-4000:]}\n"
                                  f"{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout)
    assert result["ok"] is True and result["error"] is None
    assert result["backend"] == "cpu"
    assert result["verdict"].startswith("PASS: ")
    assert result["round_trips"] and all(t["ok"] for t in result["round_trips"])
    if shutil.which("gcc") or shutil.which("cc"):
        # The wheel's compiled extension copies, not the Python fallback.
        assert result["environment"]["copy_path"] == "_hostcopy.copy_batch (C)", (
            result["environment"])
