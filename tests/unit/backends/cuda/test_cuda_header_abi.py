"""The CUDA bindings and the fake driver against NVIDIA's own cuda.h, for both batch ABIs.

The fake and the ctypes bindings were written from one reading of the API, so a
shared mistake would pass every other test. Here NVIDIA's header is the
reference: the fake is compiled against it (a definition that differs from the
real declaration fails the build) and then runs the real backend byte for
byte, and a compiled probe compares every ctypes structure and constant with it.
"""

from __future__ import annotations

import ctypes

import pytest
from cuda_fake import FAKE_SOURCE, VARIANTS, FakeDriver, FakeGpuBackend, flash_attn_rig
from cuda_headers import WHEELS, cuda_include_dir

from kvoffload_hal.backends.cuda import _driver
from kvoffload_hal.hal.backend import Direction, TransferJob
from support.abi_probe import ctypes_layout, layout_mismatches, run_probe
from support.native import compile_shared_library

# Header ABI -> (fake build variant, arguments of the batch entry point the driver resolves).
ABIS = {"12.8": ("cuda12_8", 9), "13.0": ("cuda13", 8)}

# C type -> the ctypes type the bindings use for it.
TYPES = {
    "CUmemLocation": _driver.CUmemLocation,
    "CUmemcpyAttributes": _driver.CUmemcpyAttributes,
    "CUresult": ctypes.c_int,  # every binding's restype
    "CUdevice": ctypes.c_int,
    "CUdeviceptr": ctypes.c_uint64,  # cuMemcpyAsync's dst/src; the descriptor arrays
    "cuuint64_t": ctypes.c_uint64,  # cuGetProcAddress_v2's flags
    "CUdriverProcAddressQueryResult": ctypes.c_int,  # its status out-argument
    "CUstream": ctypes.c_void_p,
}

# C constant -> the value the bindings use.
CONSTANTS = {
    name: getattr(_driver, name)
    for name in ("CUDA_SUCCESS", "CUDA_ERROR_NOT_FOUND", "CUDA_ERROR_NOT_READY",
                 "CUDA_ERROR_NOT_SUPPORTED", "CU_STREAM_NON_BLOCKING", "CU_EVENT_DISABLE_TIMING",
                 "CU_MEM_LOCATION_TYPE_DEVICE", "CU_MEM_LOCATION_TYPE_HOST",
                 "CU_MEMCPY_SRC_ACCESS_ORDER_STREAM", "CU_MEMCPY_SRC_ACCESS_ORDER_ANY")
}


@pytest.fixture(scope="module", params=sorted(ABIS))
def header(request):
    """``(abi, directory of its cuda.h)``, downloaded once and cached in .cache/."""
    return request.param, cuda_include_dir(request.param)


def test_every_ctypes_layout_and_constant_matches_cuda_h(header, tmp_path):
    abi, include = header
    expected = {name: ctypes_layout(name, t) for name, t in TYPES.items()}
    constants = {**CONSTANTS, "CUDA_VERSION": WHEELS[abi][1]}
    actual, values = run_probe(tmp_path, ["<cuda.h>"], [include], expected, constants)
    flat = {path: v for layout in expected.values() for path, v in layout.items()}
    assert len(flat) == 18  # 8 types; 2 + 8 fields, the nested type/id of both hints too
    assert layout_mismatches(flat, actual, f"cuda.h {abi}") == []
    assert values == constants
    # The ABI versions the bindings ask cuGetProcAddress_v2 for are real CUDA_VERSIONs.
    assert values["CUDA_VERSION"] == {"12.8": _driver.CUDA_12_8, "13.0": _driver.CUDA_13_0}[abi]


def test_fake_built_on_cuda_h_runs_the_backend_byte_for_byte(header, tmp_path):
    abi, include = header
    variant, num_args = ABIS[abi]
    path = compile_shared_library(
        FAKE_SOURCE, tmp_path,
        ["-fvisibility=hidden", "-DFAKE_WITH_CUDA_H", f"-I{include}", *VARIANTS[variant]],
        name=f"libfakecuda_header_{variant}.so")
    fake = FakeDriver(str(path))
    fake.lib.fake_reset()
    rig = flash_attn_rig(FakeGpuBackend("cuda:0", library_path=str(path)))
    backend = rig.backend
    try:
        assert backend.copy_path.startswith("cuMemcpyBatchAsync") and abi in backend.copy_path
        backend.submit(TransferJob(0, Direction.STORE, [3, 4, 9, 17], [0, 1, 7, 40]))
        assert [r.ok for r in backend.flush()] == [True]
        rig.assert_stored([3, 4, 9, 17], [0, 1, 7, 40])
        backend.submit(TransferJob(1, Direction.LOAD, [0, 1, 7, 40], [20, 21, 5, 30]))
        assert [r.ok for r in backend.flush()] == [True]
        rig.assert_loaded([0, 1, 7, 40], [20, 21, 5, 30])
        batches = fake.batches()
        assert len(batches) == 2 and {b.num_args for b in batches} == {num_args}
    finally:
        rig.close()
