"""Backend selection: ``KVOFFLOAD_HAL_BACKEND=auto|cpu|cuda|npu|<plugin name>``.

Backends are imported lazily, only once selected, so ``import kvoffload_hal``
works without CUDA or torch_npu. Third-party packages add backends through the
entry-point group ``kvoffload_hal.backends`` (``name = "pkg.module:Class"``) or at
run time with :func:`register_backend`.

``auto`` picks ``npu`` when torch_npu is importable and an NPU is visible, else
``cuda`` when ``torch.cuda.is_available()``, else ``cpu``.

The scheduler process never imports a backend. What it needs of one,
:func:`synchronous_compute` (it picks sync or async loads under ``load_mode:
auto``), is registry data: each built-in's in :data:`_SYNCHRONOUS`; a plug-in
says it in ``register_backend(..., synchronous_compute=True)``, or lists the same
``name = "pkg.module:Class"`` in the entry-point group
``kvoffload_hal.synchronous_backends`` as well. Undeclared means False, which is
always safe: loads are then asynchronous, and the worker still waits for each
step's copies where its backend class says compute is synchronous. ``auto``
asks vLLM's ``current_platform`` (the CPU platform computes synchronously)
rather than probing torch_npu: every vLLM process has resolved the platform
already, so asking loads nothing, and the platform is what runs the forward pass.
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
#: Plug-ins whose compute is synchronous: the same ``name = target`` as in ENTRY_POINT_GROUP.
SYNCHRONOUS_GROUP = "kvoffload_hal.synchronous_backends"
AUTO = "auto"

_BUILTIN: dict[str, str] = {
    "cpu": "kvoffload_hal.backends.cpu:CpuCopyBackend",
    "cuda": "kvoffload_hal.backends.cuda:CudaCopyBackend",
    "npu": "kvoffload_hal.backends.npu:NpuCopyBackend",
}
#: Each built-in's ``synchronous_compute``, known without importing it (a test checks
#: that the classes agree).
_SYNCHRONOUS: dict[str, bool] = {"cpu": True, "cuda": False, "npu": False}
_registered: dict[str, str] = {}
_registered_synchronous: dict[str, bool] = {}


class BackendSelectionError(RuntimeError):
    """The requested backend is unknown or cannot run here. The message is one line."""


def register_backend(name: str, target: str, synchronous_compute: bool = False) -> None:
    """Register ``name`` -> ``"module:Class"`` (a :class:`DmaCopyBackend` subclass).

    ``synchronous_compute`` repeats the class's flag for the scheduler, which
    never imports the class (see the module docstring); False when left out."""
    if name == AUTO or name in _BUILTIN:
        raise ValueError(f"backend name {name!r} is reserved")
    check_target("backend", target)
    _registered[name] = target
    _registered_synchronous[name] = bool(synchronous_compute)


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


def _requested(value: str | None) -> tuple[str, str]:
    """``(raw value, normalised name)``; the environment variable when ``value`` is None."""
    raw = value if value is not None else os.environ.get(ENV_VAR, AUTO)
    return raw, raw.strip().lower() or AUTO  # set but empty: the default


def _unknown(raw: str) -> BackendSelectionError:
    return BackendSelectionError(
        f"{ENV_VAR}={raw!r} is not a known backend; expected one of: {', '.join(backend_names())}"
    )


def resolve_backend_name(value: str | None = None) -> str:
    """The concrete backend name for ``value`` (default: the environment variable)."""
    raw, name = _requested(value)
    if name == AUTO:
        if _npu_visible():
            return "npu"
        return "cuda" if _cuda_visible() else "cpu"
    if name in _BUILTIN or name in _plugin_backends():
        return name
    raise _unknown(raw)


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
    """The selected backend's ``synchronous_compute``, without importing any backend
    module, torch_npu or a driver (see the module docstring). An unknown name fails as
    in :func:`resolve_backend_name`; a backend that cannot run here is not noticed."""
    raw, name = _requested(value)
    if name == AUTO:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()
    if name in _SYNCHRONOUS:
        return _SYNCHRONOUS[name]
    if name in _registered:
        return _registered_synchronous.get(name, False)
    target = entry_point_targets(ENTRY_POINT_GROUP).get(name)
    if target is None:
        raise _unknown(raw)
    return entry_point_targets(SYNCHRONOUS_GROUP).get(name) == target


def create_backend(value: str | None = None, device=None) -> DmaCopyBackend:
    """Instantiate the selected backend for ``device``."""
    cls = get_backend_class(value)
    logger.info("kvoffload_hal: using the %r copy backend (%s)", cls.name, cls.__qualname__)
    return cls(device)
