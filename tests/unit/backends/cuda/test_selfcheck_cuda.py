"""The self-check on the CUDA backend's real ctypes code, over the fake driver (host memory)."""

from __future__ import annotations

import pytest
from cuda_fake import CUDA_ERROR_ILLEGAL_ADDRESS, SIZE_MAX, FakeGpuBackend

from kvoffload_hal.backends.cuda import _copy
from kvoffload_hal.selfcheck import run_selfcheck
from kvoffload_hal.selfcheck.report import render_text


def _run(fake, **kwargs) -> dict:
    return run_selfcheck("cuda", device="cpu",
                         make_backend=lambda: FakeGpuBackend("cuda:0", library_path=fake.path),
                         **kwargs)


@pytest.mark.parametrize(("variant", "version", "path"), [
    ("cuda12_8", "12.8", "cuMemcpyBatchAsync (CUDA 12.8 ABI)"),
    ("cuda13", "13.0", "cuMemcpyBatchAsync_v2 (CUDA 13.0 ABI)"),
])
def test_batch_path_round_trips_byte_exact(fake, version, path):
    result = _run(fake, bandwidth_mib=1)
    assert result["ok"], result["verdict"]
    env = result["environment"]
    assert (env["runtime_version"], env["copy_path"], env["copy_mode"]) == (version, path, "batch")
    assert result["backend"] == "cuda" and len(result["round_trips"]) == 10
    assert fake.batches() and fake.calls("cuMemcpyAsync") == 0  # every copy went batched
    assert result["bandwidth"]["store_limit_gbps"] > 0
    assert result["verdict"].startswith("PASS: 10 of 10 round trips byte-exact on the 'cuda'")


@pytest.mark.parametrize("variant", ["no_batch"])
def test_loop_fallback_is_reported(fake):
    result = _run(fake, block_sizes=(16,), bandwidth_mib=0)
    assert result["ok"], result["verdict"]
    env = result["environment"]
    assert (env["runtime_version"], env["copy_path"]) == ("12.4", _copy.LOOP_PATH)
    assert env["copy_mode"] == "loop fallback" and fake.calls("cuMemcpyAsync") > 0
    assert result["verdict"].endswith("; copies use the per-copy loop fallback (slower; "
                                      "see the docs)")


def test_a_failing_driver_copy_fails_the_verdict(fake):
    fake.lib.fake_fail_batch(CUDA_ERROR_ILLEGAL_ADDRESS, SIZE_MAX, 0)  # every batch call fails
    result = _run(fake, block_sizes=(16,), bandwidth_mib=0)
    assert not result["ok"]
    assert all(t["error"].startswith("store job failed: ") and "CUDA_ERROR_ILLEGAL_ADDRESS"
               in t["error"] for t in result["round_trips"])
    assert result["verdict"].startswith("FAIL: 5 of 5 round trips wrong on the 'cuda' backend")


def test_copy_kernel_round_trips_byte_exact_and_is_reported(fake):
    result = run_selfcheck("cuda", device="cpu", block_sizes=(16,), bandwidth_mib=1,
                           make_backend=lambda: FakeGpuBackend("cuda:0", library_path=fake.path,
                                                               kernel_max_bytes=1 << 20,
                                                               kernel_directions="all"))
    assert result["ok"], result["verdict"]
    assert result["environment"]["copy_kernel"].startswith("copy kernel for loads and stores")
    assert fake.launches() and not fake.batches()  # every copy went by the kernel
    assert "\nkernel:    copy kernel for loads and stores" in render_text(result)
