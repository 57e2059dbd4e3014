"""Build the package's wheel and install it into a scratch environment.

The wheel is built from a copy of the checkout, so that the build writes no
``build/`` or ``*.egg-info`` into the tree (an editable install may be building
there at the same time) and no stale ``build/lib`` left by an earlier build can
slip modules into the wheel that ``setup.py`` no longer ships.

The scratch environment is a venv without pip whose site-packages holds the
installed wheel and one ``.pth`` line naming the running interpreter's
site-packages, for torch, numpy and vLLM. Python appends such a line to
``sys.path`` without executing the ``.pth`` files found there, so the editable
install's finder (``__editable__*.pth``) is never loaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

#: What the copy of the checkout leaves out: VCS data, environments, build outputs
#: and caches (the ignored paths of .gitignore), and compiled extensions, so the
#: wheel's extension is the one its own build compiled.
_NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", "*.so",
    ".cache", ".hypothesis", ".pytest_cache", ".ruff_cache", "models", "htmlcov", ".coverage")

#: Environment variables that would let the scratch interpreter see the checkout.
_LEAKY_VARS = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE")


def _run(cmd: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                           f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


def build_wheel(repo_root: Path, work_dir: Path) -> Path:
    """Copy ``repo_root`` under ``work_dir``, build its wheel offline; return the wheel."""
    source, dist = work_dir / "source", work_dir / "dist"
    shutil.copytree(repo_root, source, ignore=_NOT_COPIED)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-index", "-w", str(dist), str(source)], "pip wheel", cwd=work_dir)
    wheels = sorted(dist.glob("kvoffload_hal-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one kvoffload_hal wheel in {dist}, found {wheels}")
    return wheels[0]


def _host_site_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys((paths["purelib"], paths["platlib"])))


def make_scratch_env(env_dir: Path) -> Path:
    """A venv without pip that also sees this interpreter's site-packages; its python."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], "python -m venv")
    python = env_dir / "bin" / "python"
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                "reading the scratch site-packages", env=clean_env()).stdout.strip()
    (Path(site) / "host_site_packages.pth").write_text("\n".join(_host_site_dirs()) + "\n")
    return python


def install_wheel(python: Path, wheel: Path) -> None:
    """``pip install --no-deps`` of ``wheel`` into the environment of ``python``, offline."""
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", "--no-compile", str(wheel)], "pip install of the wheel", env=clean_env())


def clean_env() -> dict[str, str]:
    """This process's environment without the variables that put the checkout on sys.path."""
    return {k: v for k, v in os.environ.items() if k not in _LEAKY_VARS}


def run_python(python: Path, args: list[str], cwd: Path,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python args`` in ``cwd`` with :func:`clean_env`; the result, whatever its status."""
    return subprocess.run([str(python), *args], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True, timeout=timeout)
