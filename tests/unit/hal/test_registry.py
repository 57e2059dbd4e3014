"""Backend selection through KVOFFLOAD_HAL_BACKEND, register_backend and entry points."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvoffload_hal.backends.cpu import CpuCopyBackend
from kvoffload_hal.hal import registry
from kvoffload_hal.hal.registry import (
    ENV_VAR,
    BackendSelectionError,
    backend_names,
    create_backend,
    get_backend_class,
    register_backend,
    resolve_backend_name,
)
from support.entry_points import install_entry_points

PLUGIN_MODULE = """
from kvoffload_hal.backends.cpu import CpuCopyBackend
from kvoffload_hal.hal.threaded import ThreadedCopyBackend


class PluginBackend(CpuCopyBackend):
    name = "{name}"


class MissingLibBackend(ThreadedCopyBackend):
    name = "missing"

    @classmethod
    def unavailable_reason(cls):
        return "libfoo.so.1 is not installed"


class NotABackend:
    pass
"""


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "_registered", {})
    monkeypatch.delenv(ENV_VAR, raising=False)


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    name = f"kvhal_plugin_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(PLUGIN_MODULE.format(name="plug"))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and message
    return message


def test_auto_is_cpu_without_accelerators():
    if torch.cuda.is_available() or importlib.util.find_spec("torch_npu"):
        pytest.skip("an accelerator runtime is present")
    assert resolve_backend_name() == "cpu"
    assert get_backend_class() is CpuCopyBackend
    backend = create_backend()
    assert isinstance(backend, CpuCopyBackend)
    backend.shutdown()


def test_explicit_cpu_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_VAR, " CPU ")
    assert resolve_backend_name() == "cpu"
    assert get_backend_class() is CpuCopyBackend


def test_unknown_name_lists_the_valid_names(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "tpu")
    with pytest.raises(BackendSelectionError) as exc:
        get_backend_class()
    message = _one_line(exc)
    assert "'tpu'" in message
    for name in ("auto", "cpu", "cuda", "npu"):
        assert name in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_cuda_without_a_gpu_names_what_is_missing():
    with pytest.raises(BackendSelectionError) as exc:
        get_backend_class("cuda")
    message = _one_line(exc)
    assert "'cuda'" in message and "CUDA" in message


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu present")
def test_npu_without_torch_npu_names_what_is_missing():
    with pytest.raises(BackendSelectionError) as exc:
        get_backend_class("npu")
    assert "torch_npu" in _one_line(exc)


def test_registered_backend_is_selectable_and_copies(plugin_module, monkeypatch):
    register_backend("plug", f"{plugin_module}:PluginBackend")
    assert "plug" in backend_names()
    monkeypatch.setenv(ENV_VAR, "plug")
    backend = create_backend()
    assert type(backend).__name__ == "PluginBackend" and backend.name == "plug"
    src = torch.arange(64, dtype=torch.uint8).view(4, 16)
    host = backend.allocate_host(64)
    (region,) = backend.describe_kv_tensor(src, 4)
    backend.bind([region], [type(region)(host.data_ptr(), 4, 16, 16)])
    from kvoffload_hal.hal.backend import Direction, TransferJob

    backend.submit(TransferJob(0, Direction.STORE, [2], [0]))
    assert [r.ok for r in backend.flush()] == [True]
    assert torch.equal(host[:16], src[2])
    backend.shutdown()


def test_register_backend_rejects_reserved_names_and_bad_targets():
    for name in ("auto", "cpu", "cuda", "npu"):
        with pytest.raises(ValueError, match="reserved"):
            register_backend(name, "x:Y")
    with pytest.raises(ValueError, match="module:Class"):
        register_backend("x", "no_colon")


def test_registered_backend_failures_are_one_line(plugin_module):
    register_backend("missing", f"{plugin_module}:MissingLibBackend")
    register_backend("notone", f"{plugin_module}:NotABackend")
    register_backend("gone", "kvhal_no_such_module:Backend")
    with pytest.raises(BackendSelectionError) as exc:
        get_backend_class("missing")
    assert "libfoo.so.1 is not installed" in _one_line(exc)
    with pytest.raises(BackendSelectionError) as exc:
        get_backend_class("notone")
    assert "not a DmaCopyBackend" in _one_line(exc)
    with pytest.raises(BackendSelectionError) as exc:
        get_backend_class("gone")
    assert "cannot be imported" in _one_line(exc)


def test_entry_point_backend_from_a_real_dist_info(tmp_path, monkeypatch):
    module = "kvhal_ep_plugin_mod"
    (tmp_path / f"{module}.py").write_text(PLUGIN_MODULE.format(name="epback"))
    install_entry_points(tmp_path, monkeypatch,
                         {registry.ENTRY_POINT_GROUP: {"epback": f"{module}:PluginBackend"}})
    assert "epback" in backend_names()
    monkeypatch.setenv(ENV_VAR, "epback")
    assert resolve_backend_name() == "epback"
    cls = get_backend_class()
    assert cls.__module__ == module and cls.name == "epback"


def test_import_loads_no_vendor_runtime():
    from support.imports import loaded_by

    added = loaded_by("""
        import kvoffload_hal
        import kvoffload_hal.hal
        from kvoffload_hal.hal import registry
        registry.backend_names()
        registry.get_backend_class("cpu")
    """)
    assert added == {"modules": [], "libraries": [], "cuda_initialized": False}


def test_an_empty_backend_variable_means_auto(monkeypatch):
    from kvoffload_hal.hal.registry import ENV_VAR, resolve_backend_name

    monkeypatch.setenv(ENV_VAR, "")
    assert resolve_backend_name() == resolve_backend_name("auto")
    monkeypatch.setenv(ENV_VAR, "  ")
    assert resolve_backend_name() == resolve_backend_name("auto")
