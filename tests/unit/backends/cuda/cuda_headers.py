"""NVIDIA's ``cuda.h`` for the ABI tests, from the CUDA runtime wheels on the package index.

``nvidia-cuda-runtime-cu12==12.8.*`` ships it as ``nvidia/cuda_runtime/include/cuda.h``
and ``nvidia-cuda-runtime==13.0.*`` as ``nvidia/cu13/include/cuda.h``. Each wheel is
downloaded once with pip (no dependencies, nothing installed), only ``cuda.h`` is
extracted, and it is cached under ``.cache/cuda-headers/<abi>/`` in the repository
(ignored by git). Without network the calling test is skipped, saying why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[4]
CACHE_DIR = REPO_ROOT / ".cache" / "cuda-headers"

# ABI -> (pip requirement, the CUDA_VERSION its cuda.h must define).
WHEELS = {
    "12.8": ("nvidia-cuda-runtime-cu12==12.8.*", 12080),
    "13.0": ("nvidia-cuda-runtime==13.0.*", 13000),
}


def cuda_include_dir(abi: str) -> Path:
    """A directory holding the ``cuda.h`` of ``abi`` ("12.8" or "13.0")."""
    requirement, _ = WHEELS[abi]
    target = CACHE_DIR / abi
    if (target / "cuda.h").is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input",
               "--disable-pip-version-check", "-q", requirement, "-d", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.skip(f"pip download {requirement} (for its cuda.h) timed out after 300 s")
        if proc.returncode != 0:
            why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"cannot download {requirement} for its cuda.h (no network?): {why}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        assert wheels, f"pip download {requirement} succeeded but left no wheel in {tmp}"
        header = _extract_cuda_h(wheels[0])
    target.mkdir(parents=True, exist_ok=True)
    partial = target / f"cuda.h.{os.getpid()}"
    partial.write_bytes(header)
    partial.replace(target / "cuda.h")  # atomic: a concurrent run sees all of it or nothing
    return target


def _extract_cuda_h(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith("/include/cuda.h")]
        assert names, (f"{wheel.name} has no */include/cuda.h: the header moved to another "
                       "wheel (look in nvidia-cuda-nvcc or nvidia-cuda-cccl)")
        return zf.read(names[0])
