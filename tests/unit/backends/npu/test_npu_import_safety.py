"""Without torch_npu or CANN: the package imports; selecting ``npu`` fails with one clear line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvoffload_hal.backends.npu._acl import ACL_LIBRARY_ENV
from kvoffload_hal.hal.registry import ENV_VAR, BackendSelectionError, create_backend

PROBE = textwrap.dedent("""
    import sys
    import kvoffload_hal
    import kvoffload_hal.backends.npu
    from kvoffload_hal.hal.registry import BackendSelectionError, create_backend
    assert sys.modules.get("torch_npu") is None, "importing the backend must not import torch_npu"
    try:
        create_backend()
    except BackendSelectionError as e:
        print("ERROR:" + str(e))
    else:
        print("CREATED")
""")


def test_fresh_interpreter_without_torch_npu():
    env = {**os.environ, ENV_VAR: "npu", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    env.pop(ACL_LIBRARY_ENV, None)
    # Block torch_npu even on a machine where it happens to be installed.
    code = "import sys; sys.modules['torch_npu'] = None\n" + PROBE
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip().splitlines()
    assert out == ["ERROR:backend 'npu' cannot run here: torch_npu is not importable"]


def test_in_process_without_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    monkeypatch.setenv(ENV_VAR, "npu")
    with pytest.raises(BackendSelectionError, match=r"^backend 'npu' cannot run here: "
                                                    r"torch_npu is not importable$"):
        create_backend()


def test_torch_npu_without_cann_library(npu_env, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "npu")
    monkeypatch.setenv(ACL_LIBRARY_ENV, "/nonexistent/libascendcl.so")
    with pytest.raises(BackendSelectionError) as info:
        create_backend()
    message = str(info.value)
    assert "libascendcl.so cannot be loaded" in message and "\n" not in message


def test_selected_on_the_fake_runtime(npu_env, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "npu")
    backend = create_backend()
    npu_env.built.append(backend)
    assert backend.name == "npu" and backend.copy_path == "aclrtMemcpyBatchAsyncV2"
