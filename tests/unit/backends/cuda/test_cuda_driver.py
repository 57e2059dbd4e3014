"""The ctypes bindings: library loading, ABI resolution, error reporting, availability."""

from __future__ import annotations

import pytest
import torch

from kvoffload_hal.backends.cuda import CudaCopyBackend, _driver
from kvoffload_hal.backends.cuda._driver import (
    CUDA_12_8,
    CUDA_13_0,
    LIBRARY_ENV_VAR,
    CudaError,
    load_driver,
    probe_library,
)
from kvoffload_hal.hal.registry import BackendSelectionError, get_backend_class


def test_import_loads_no_cuda_library(build_fake):
    """Importing the backend opens neither libcuda nor the library the env var names."""
    from support.imports import loaded_by

    fake_path = build_fake("cuda12_8")
    env = {LIBRARY_ENV_VAR: fake_path, "PATH": "/usr/bin:/bin"}
    code = f"""
        import kvoffload_hal.backends.cuda
        assert {fake_path!r} not in open("/proc/self/maps").read(), "the fake driver was loaded"
    """
    assert loaded_by(code, env=env)["libraries"] == []


@pytest.mark.parametrize(("variant", "cuda_version", "symbol"), [
    ("cuda12_8", CUDA_12_8, "cuMemcpyBatchAsync"),
    ("cuda13", CUDA_13_0, "cuMemcpyBatchAsync_v2"),
])
def test_batch_abi_is_resolved_for_the_driver_version(fake, cuda_version, symbol):
    batch, why_not = load_driver(fake.path).resolve_batch_memcpy()
    assert batch is not None and why_not == ""
    assert batch.cuda_version == cuda_version
    assert batch.symbol == symbol and symbol in batch.label
    assert fake.calls("cuGetProcAddress_v2") == 1  # newest ABI the driver offers, first try


@pytest.mark.parametrize(("variant", "reason"), [
    ("no_batch", "offers no cuMemcpyBatchAsync"),
    ("no_proc_address", "has no cuGetProcAddress_v2"),
])
def test_missing_batch_entry_point_is_reported(fake, reason):
    batch, why_not = load_driver(fake.path).resolve_batch_memcpy()
    assert batch is None
    assert reason in why_not


def test_library_path_comes_from_argument_then_env_var(fake, monkeypatch):
    monkeypatch.setenv(LIBRARY_ENV_VAR, fake.path)
    assert load_driver().path == fake.path
    other = fake.path.replace("cuda12_8", "other")
    with pytest.raises(OSError, match="other"):  # the argument wins over the env var
        load_driver(other)
    monkeypatch.delenv(LIBRARY_ENV_VAR)
    assert _driver._library_path(None) == "libcuda.so.1"


def test_library_without_driver_symbols_is_rejected():
    with pytest.raises(RuntimeError, match="does not export cuInit"):
        load_driver("libc.so.6")


def test_errors_name_the_function_and_the_code(fake):
    driver = load_driver(fake.path)
    err = driver.error("cuMemcpyBatchAsync", 700, " at descriptor 3 of 8")
    assert isinstance(err, CudaError) and err.code == 700
    assert str(err) == ("cuMemcpyBatchAsync failed: CUDA_ERROR_ILLEGAL_ADDRESS (700) "
                        "at descriptor 3 of 8")
    assert driver.error_name(12345) == "CUDA_ERROR_UNRECOGNIZED"
    with pytest.raises(CudaError, match="cuInit failed: CUDA_ERROR_INVALID_VALUE"):
        driver.check(driver.cuInit(7), "cuInit")


def test_unavailable_without_a_visible_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert CudaCopyBackend.unavailable_reason() == (
        "no CUDA device is visible (torch.cuda.is_available() is False)")
    with pytest.raises(BackendSelectionError, match="no CUDA device is visible"):
        get_backend_class("cuda")


def test_unavailable_when_the_library_cannot_be_loaded(fake, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    missing = str(tmp_path / "libcuda.so.1")
    monkeypatch.setenv(LIBRARY_ENV_VAR, missing)
    reason = CudaCopyBackend.unavailable_reason()
    assert reason.startswith(f"{missing} cannot be loaded: ") and "\n" not in reason
    monkeypatch.setenv(LIBRARY_ENV_VAR, fake.path)
    assert CudaCopyBackend.unavailable_reason() is None
    assert probe_library(fake.path) is None
    assert fake.calls("cuInit") == 0  # probing initialised nothing
    assert get_backend_class("cuda") is CudaCopyBackend
