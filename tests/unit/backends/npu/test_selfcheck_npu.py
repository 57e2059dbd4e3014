"""The self-check on the NPU backend's real ctypes code, over the fake libascendcl and torch.npu."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload_hal.backends.npu import NpuCopyBackend
from kvoffload_hal.backends.npu._acl import ACL_LIBRARY_ENV, PER_COPY
from kvoffload_hal.selfcheck import run_selfcheck
from support.native import compile_shared_library

FAKE_SOURCE = Path(__file__).with_name("fake_ascendcl.c")


def _run(npu_env, **kwargs) -> dict:
    def make() -> NpuCopyBackend:
        npu_env.built.append(NpuCopyBackend())
        return npu_env.built[-1]

    return run_selfcheck("npu", make_backend=make, device="cpu", **kwargs)


@pytest.mark.parametrize(("variant", "path", "mode"), [
    ("full", "aclrtMemcpyBatchAsyncV2", "batch"),
    ("v1", "aclrtMemcpyBatchAsync", "batch"),
    ("none", PER_COPY, "loop fallback"),
])
def test_round_trips_byte_exact_on_each_copy_path(npu_env, variant, path, mode):
    acl = npu_env.use(variant)
    result = _run(npu_env, bandwidth_mib=1 if variant == "full" else 0)
    assert result["ok"], result["verdict"]
    env = result["environment"]
    assert (env["runtime_version"], env["copy_path"], env["copy_mode"]) == ("9.1.0", path, mode)
    calls = {"full": acl.v2_calls(), "v1": acl.v1_calls(), "none": acl.copy_calls()}[variant]
    assert calls > 0 and calls == acl.total_calls()  # every copy took the reported path
    assert result["verdict"].startswith("PASS: 10 of 10 round trips byte-exact on the 'npu'")


def test_a_runtime_without_aclrtGetVersion_reports_unknown(npu_env, tmp_path):
    lib = compile_shared_library(FAKE_SOURCE, tmp_path, ["-DFAKE_NO_GET_VERSION"],
                                 name="libascendcl.so")
    npu_env.monkeypatch.setenv(ACL_LIBRARY_ENV, str(lib))
    result = _run(npu_env, block_sizes=(16,), bandwidth_mib=0)
    assert result["ok"], result["verdict"]
    assert result["environment"]["runtime_version"] == "unknown"


def test_a_failing_batch_call_fails_the_verdict(npu_env):
    acl = npu_env.use("full")
    acl.fail_call(1, 507899)  # the first copy call of the first check fails
    result = _run(npu_env, block_sizes=(16,), bandwidth_mib=0)
    assert not result["ok"]
    first = result["round_trips"][0]
    assert first["error"].startswith("store job failed: ") and "507899" in first["error"]
    assert all(t["ok"] for t in result["round_trips"][1:])
    assert result["verdict"].startswith("FAIL: 1 of 5 round trips wrong on the 'npu' backend")
