"""Backend selection: ``KVOFFLOAD_HAL_BACKEND=auto|cpu|cuda|npu|<plugin name>``.

Backends are imported lazily, only once selected, so ``import kvoffload_hal``
works without CUDA or torch_npu. Third-party packages add backends through the
entry-point group ``kvoffload_hal.backends`` (``name = "pkg.module:Class"``) or at
run time with :func:`register_backend`.

``auto`` picks ``npu`` when torch_npu is importable and an NPU is visible, else
``cuda`` when ``torch.cuda.is_available()``, else ``cpu``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from importlib.metadata import entry_points

from kvoffload_hal.hal.backend import DmaCopyBackend
from kvoffload_hal.logger import init_logger

logger = init_logger(__name__)

ENV_VAR = "KVOFFLOAD_HAL_BACKEND"
ENTRY_POINT_GROUP = "kvoffload_hal.backends"
AUTO = "auto"

_BUILTIN: dict[str, str] = {
    "cpu": "kvoffload_hal.backends.cpu:CpuCopyBackend",
    "cuda": "kvoffload_hal.backends.cuda:CudaCopyBackend",
    "npu": "kvoffload_hal.backends.npu:NpuCopyBackend",
}
_registered: dict[str, str] = {}


class BackendSelectionError(RuntimeError):
    """The requested backend is unknown or cannot run here. The message is one line."""


def register_backend(name: str, target: str) -> None:
    """Register ``name`` -> ``"module:Class"`` (a :class:`DmaCopyBackend` subclass)."""
    if name == AUTO or name in _BUILTIN:
        raise ValueError(f"backend name {name!r} is reserved")
    if ":" not in target:
        raise ValueError(f"backend target {target!r} must look like 'package.module:Class'")
    _registered[name] = target


def _plugin_backends() -> dict[str, str]:
    found = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
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
    module_name, _, class_name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise BackendSelectionError(f"backend {name!r} ({target}) cannot be imported: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, DmaCopyBackend)):
        raise BackendSelectionError(f"backend {name!r} ({target}) is not a DmaCopyBackend subclass")
    reason = cls.unavailable_reason()
    if reason is not None:
        raise BackendSelectionError(f"backend {name!r} cannot run here: {reason}")
    return cls


def create_backend(value: str | None = None, device=None) -> DmaCopyBackend:
    """Instantiate the selected backend for ``device``."""
    cls = get_backend_class(value)
    logger.info("kvoffload_hal: using the %r copy backend (%s)", cls.name, cls.__qualname__)
    return cls(device)
