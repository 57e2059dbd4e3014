"""Which backend the self-check uses and why, and what it found around it.

Nothing here imports torch_npu or a CUDA runtime until a backend is being
chosen: the registry probes ``npu`` then ``cuda`` only for ``auto``, as the
connector does.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass

import torch

import kvoffload_hal
from kvoffload_hal.hal.backend import DmaCopyBackend
from kvoffload_hal.hal.registry import (
    AUTO,
    ENV_VAR,
    BackendSelectionError,
    get_backend_class,
    resolve_backend_name,
)

__all__ = ["Selection", "choose_backend", "copy_mode", "default_device", "describe_environment"]

# The variables that change what the backends do (README, "Environment variables").
_ENV_VARS = (ENV_VAR, "KVOFFLOAD_HAL_CUDA_LIBRARY", "KVOFFLOAD_HAL_CUDA_MAX_DESCRIPTORS",
             "KVOFFLOAD_HAL_ACL_LIBRARY", "KVOFFLOAD_HAL_NPU_MAX_BATCH_DESCRIPTORS")

_CHOSEN_BECAUSE = {
    "npu": "torch_npu is importable and an NPU is visible",
    "cuda": "torch.cuda.is_available() is True",
    "cpu": "no NPU and no CUDA device found",
}


@dataclass(frozen=True)
class Selection:
    """The backend name to use and one line saying why."""

    name: str
    reason: str


def choose_backend(requested: str | None) -> Selection:
    """``requested`` (``--backend``), else ``$KVOFFLOAD_HAL_BACKEND``, else ``auto``.

    Raises :class:`BackendSelectionError` (one line) for an unknown name.
    """
    if requested is not None:
        raw, source = requested, "--backend"
    elif os.environ.get(ENV_VAR, "").strip():
        raw, source = os.environ[ENV_VAR], ENV_VAR
    else:
        raw, source = AUTO, "default"
    name = resolve_backend_name(raw)
    if raw.strip().lower() != AUTO:
        return Selection(name, f"requested with {source}={raw.strip()}")
    skipped = []
    for candidate in ("npu", "cuda"):
        if candidate == name:
            break
        try:
            get_backend_class(candidate)
        except BackendSelectionError as e:
            skipped.append(str(e))
    because = _CHOSEN_BECAUSE.get(name, "selected by the registry")
    return Selection(name, "; ".join([f"auto ({source}): {name}, since {because}", *skipped]))


def default_device(name: str) -> torch.device:
    """Where the self-check puts its KV tensors for backend ``name``."""
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if name == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu; the backend was chosen)

        return torch.device("npu", torch.npu.current_device())
    return torch.device("cpu")


def copy_mode(backend: DmaCopyBackend) -> str:
    """``batch``, ``loop fallback``, ``host memcpy`` or ``unknown`` for ``backend``'s copy path."""
    if backend.host_memcpy:
        return "host memcpy"
    if backend.copy_path is None:
        return "unknown"
    return "loop fallback" if backend.copy_path_is_fallback else "batch"


def _device_name(device: torch.device) -> str | None:
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_name(device)
        if device.type == "npu":
            return str(torch.npu.get_device_name(device))
    except Exception:  # noqa: BLE001 - informative only
        return None
    return None


def cpu_model() -> str:
    """The CPU's model name (``lscpu``'s), recorded beside every measured figure."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _runtime_version(backend: DmaCopyBackend | None) -> str:
    """The backend's runtime version; "unknown" where it has a runtime that will not say,
    "n/a" where it has none (``runtime_name`` None: host memcpy)."""
    version = backend.runtime_version if backend is not None else None
    if version:
        return version
    return "unknown" if backend is not None and backend.runtime_name is not None else "n/a"


def describe_environment(backend: DmaCopyBackend | None, device: torch.device) -> dict:
    """Versions, copy path and settings, as plain JSON values; "unknown" where not found."""
    return {
        "device": str(device),
        "device_name": _device_name(device),
        "runtime_version": _runtime_version(backend),
        "copy_path": (backend.copy_path if backend is not None else None) or "unknown",
        "copy_mode": copy_mode(backend) if backend is not None else "unknown",
        "copy_kernel": backend.copy_kernel if backend is not None else None,
        "kvoffload_hal": kvoffload_hal.__version__,
        "torch": torch.__version__,
        # The CUDA torch was built with, and the CANN torch_npu reports (None where absent).
        "torch_cuda": torch.version.cuda,
        "torch_cann": getattr(torch.version, "cann", None),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "env": {k: os.environ[k] for k in _ENV_VARS if k in os.environ},
    }
