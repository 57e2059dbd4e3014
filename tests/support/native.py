"""Native fakes: a vendor library written in C, compiled by a test fixture.

The fakes export the real symbol names and signatures, so the production
ctypes code loads them unchanged (see ``tests/unit/backends/*/fake_*.c``).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

# Warnings are errors: a fake that compiles with a warning may not match the real ABI.
BASE_FLAGS = ("-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-pthread")


def compile_shared_library(source: Path, out_dir: Path, extra_flags: Sequence[str] = (),
                           name: str | None = None) -> Path:
    """Compile ``source`` into ``out_dir/name`` (default ``lib<stem>.so``); return its path.

    Skips the calling test when no C compiler (``gcc`` or ``cc``) is on PATH;
    raises with the compiler's output when the build fails.
    """
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip(f"no C compiler (gcc/cc) to build {source.name}")
    path = Path(out_dir) / (name or f"lib{Path(source).stem}.so")
    path.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([compiler, *BASE_FLAGS, *extra_flags, "-o", str(path), str(source)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{compiler} could not build {source} "
                           f"(flags {' '.join(extra_flags) or 'none'}):\n{proc.stderr}")
    return path
