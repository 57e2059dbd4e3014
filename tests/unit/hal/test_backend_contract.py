"""What every backend offers (the ABC's contract), and what the scheduler knows of a
backend without importing it."""

import os

import pytest

from kvoffload_hal.backends.cpu import CpuCopyBackend
from kvoffload_hal.hal import registry
from kvoffload_hal.hal.backend import DmaCopyBackend
from kvoffload_hal.plugins import load_class


def _builtin_class(name):
    # Imported without the "can it run here" check: the fake-free class itself.
    return load_class("backend", name, registry._BUILTIN[name], DmaCopyBackend, RuntimeError)


@pytest.mark.parametrize("name", sorted(registry._BUILTIN))
def test_each_built_in_declares_the_contract(name):
    cls = _builtin_class(name)
    # The registry's word for the scheduler is the class's own.
    assert registry.synchronous_compute(name) is cls.synchronous_compute
    assert cls.host_memcpy is (name == "cpu")
    assert (cls.runtime_name is None) is (name == "cpu")
    assert bool(cls.fallback_copy_paths) is (name != "cpu")
    for attr in ("copy_path", "runtime_version", "copy_path_is_fallback"):
        assert isinstance(getattr(cls, attr), property), attr


def test_the_cpu_backend_reports_its_path_and_no_fallback():
    backend = CpuCopyBackend()
    assert backend.copy_path in ("_hostcopy.copy_batch (C)", "ctypes.memmove loop")
    assert not backend.copy_path_is_fallback and backend.runtime_version is None


def test_a_backend_that_declares_nothing_is_unknown_not_wrong():
    class Minimal(CpuCopyBackend):
        host_memcpy = False

        @property
        def copy_path(self):
            return DmaCopyBackend.copy_path.fget(self)

    backend = Minimal()
    assert backend.copy_path is None and not backend.copy_path_is_fallback


def test_a_plug_in_says_whether_its_compute_is_synchronous(monkeypatch):
    registry.register_backend("contract-sync", "nowhere:Backend", synchronous_compute=True)
    registry.register_backend("contract-async", "nowhere:Backend")
    assert registry.synchronous_compute("contract-sync") is True
    assert registry.synchronous_compute("contract-async") is False  # the safe default
    with pytest.raises(registry.BackendSelectionError, match="not a known backend"):
        registry.synchronous_compute("contract-none")


@pytest.mark.parametrize("backend", ["cuda", "npu"])
def test_the_scheduler_side_imports_no_backend(backend):
    """Resolving the capabilities, as the scheduler process does, with an accelerator
    backend selected loads no backend module and no vendor runtime."""
    from support.imports import loaded_by

    added = loaded_by("""
        import sys
        from types import SimpleNamespace
        from kvoffload_hal.capabilities import resolve_capabilities
        from kvoffload_hal.config import OffloadConfig

        groups = SimpleNamespace(kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=16))])
        caps = resolve_capabilities(groups, OffloadConfig.from_extra_config({}))
        assert caps.synchronous_compute is False, caps
        loaded = [m for m in sys.modules if m.startswith("kvoffload_hal.backends")]
        assert not loaded, loaded
    """, env=dict(os.environ, KVOFFLOAD_HAL_BACKEND=backend))
    assert added == {"modules": [], "libraries": [], "cuda_initialized": False}
