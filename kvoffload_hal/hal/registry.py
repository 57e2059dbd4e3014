"""Backend selection: ``KVOFFLOAD_HAL_BACKEND=auto|cpu|cuda|npu|<plugin name>``.

Backends are imported lazily, only once selected, so ``import kvoffload_hal``
works without CUDA or torch_npu. Third-party packages add backends through the
entry-point group ``kvoffload_hal.backends`` (``name = "pkg.module:Class"``) or at
run time with :func:`register_backend`.

``auto`` picks ``npu`` when torch_npu is importable and an NPU is visible, else
``cuda`` when ``torch.cuda.is_available()``, else ``cpu``.

The scheduler process never imports a backend: what it needs of one,
:func:`synchronous_compute`, is registry data (each built-in's below; a
plug-in's from ``register_backend(..., synchronous_compute=True)``, else False,
which is always safe: loads are then asynchronous, and the worker still waits
for copies where its backend class says compute is synchronous). For ``auto``
it asks vLLM's platform (the CPU platform computes synchronously) instead of
probing torch_npu.
"""

from __future__ import annotations

import importlib.util
import os

from kvoffload_hal.hal.backend import DmaCopyBackend
from kvoffload_hal.logger import init_logger
from kvoffload_hal.plugins import check_target, entry_point_targets, load_class

logger = init_logger(__name__)

ENV_VAR = "KVOFFLOAD_HAL_BACKEND"
ENTRY_POINT_GROUP = "kvoffload_hal.backends"
AUTO = "auto"

_BUILTIN: dict[str, str] = {
    "cpu": "kvoffload_hal.backends.cpu:CpuCopyBackend",
    "cuda": "kvoffload_hal.backends.cuda:CudaCopyBackend",
    "npu": "kvoffload_hal.backends.npu:NpuCopyBackend",
}
# Whether each built-in's compute is synchronous (its class's synchronous_compute).
_SYNCHRONOUS = {"cpu": True, "cuda": False, "npu": False}
_registered: dict[str, str] = {}
_registered_synchronous: dict[str, bool] = {}


class BackendSelectionError(RuntimeError):
    """The requested backend is unknown or cannot run here. The message is one line."""


def register_backend(name: str, target: str, synchronous_compute: bool = False) -> None:
    """Register ``name`` -> ``"module:Class"`` (a :class:`DmaCopyBackend` subclass);
    ``synchronous_compute`` as its class says (see the module docstring)."""
    if name == AUTO or name in _BUILTIN:
        raise ValueError(f"backend name {name!r} is reserved")
    check_target("backend", target)
    _registered[name] = target
    _registered_synchronous[name] = synchronous_compute


def _plugin_backends() -> dict[str, str]:
    found = entry_point_targets(ENTRY_POINT_GROUP)
    found.update(_registered)
    return found


def backend_names() -> list[str]:
    """Every valid value of the environment variable."""
    return [AUTO, *_BUILTIN, *sorted(set(_plugin_backends()) - set(_BUILTIN))]


def _npu_visible() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)

        return bool(torch.npu.is_available())
    except Exception:  # noqa: BLE001 - a broken install means "no NPU here"
        return False


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_backend_name(value: str | None = None) -> str:
    """The concrete backend name for ``value`` (default: the environment variable)."""
    raw = value if value is not None else os.environ.get(ENV_VAR, AUTO)
    name = raw.strip().lower() or AUTO  # set but empty: the default
    if name == AUTO:
        if _npu_visible():
            return "npu"
        return "cuda" if _cuda_visible() else "cpu"
    if name in _BUILTIN or name in _plugin_backends():
        return name
    raise BackendSelectionError(
        f"{ENV_VAR}={raw!r} is not a known backend; expected one of: {', '.join(backend_names())}"
    )


def get_backend_class(value: str | None = None) -> type[DmaCopyBackend]:
    """Import and return the selected backend class, checking it can run here."""
    name = resolve_backend_name(value)
    target = _BUILTIN.get(name) or _plugin_backends()[name]
    cls = load_class("backend", name, target, DmaCopyBackend, BackendSelectionError)
    reason = cls.unavailable_reason()
    if reason is not None:
        raise BackendSelectionError(f"backend {name!r} cannot run here: {reason}")
    return cls


def synchronous_compute(value: str | None = None) -> bool:
    """Whether the selected backend's compute is synchronous, without importing it."""
    raw = value if value is not None else os.environ.get(ENV_VAR, AUTO)
    name = raw.strip().lower() or AUTO
    if name == AUTO:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()
    if name in _SYNCHRONOUS:
        return _SYNCHRONOUS[name]
    if name in _registered_synchronous:
        return _registered_synchronous[name]
    resolve_backend_name(value)  # an unknown name fails here, with the valid ones
    return False


def create_backend(value: str | None = None, device=None) -> DmaCopyBackend:
    """Instantiate the selected backend for ``device``."""
    cls = get_backend_class(value)
    logger.info("kvoffload_hal: using the %r copy backend (%s)", cls.name, cls.__qualname__)
    return cls(device)
