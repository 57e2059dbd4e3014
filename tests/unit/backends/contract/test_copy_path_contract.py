"""Every built-in backend keeps the ABC's contract for ``copy_path``,
``copy_path_is_fallback`` and ``runtime_version`` (see ``DmaCopyBackend``): the values
before bind, once bound and after copies, on the CPU and on the fake CUDA and ACL runtimes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from ascend_kv import ascend_kv, bind_rig
from cuda_fake import CUDA_ERROR_NOT_SUPPORTED, SIZE_MAX, FakeDriver, FakeGpuBackend
from cuda_fake import flash_attn_rig as cuda_rig
from fake_acl import FakeAcl
from fake_torch_npu import FakeNpuModule, fake_torch_npu_module

from kvoffload_hal.backends.cpu import CpuCopyBackend
from kvoffload_hal.backends.cpu import backend as cpu_backend
from kvoffload_hal.backends.cuda._copy import LOOP_PATH
from kvoffload_hal.backends.npu._acl import ACL_LIBRARY_ENV, BATCH_V2, PER_COPY
from kvoffload_hal.hal.backend import Direction, DmaCopyBackend, TransferJob
from kvoffload_hal.metrics import CopyPathWatch, StatsLedger
from support.backend_rig import BackendRig

CPU_PATH = ("_hostcopy.copy_batch (C)" if cpu_backend._hostcopy is not None
            else "ctypes.memmove loop")
CUDA_BATCH = "cuMemcpyBatchAsync (CUDA 12.8 ABI)"


@dataclass(frozen=True)
class Case:
    backend: str
    variant: str | None
    #: copy_path and runtime_version when built, once bound, after the first copies
    paths: tuple[str | None, str, str]
    versions: tuple[str | None, str | None, str | None]
    #: the runtime answers "not supported" to the batched call from the first copy on
    refuse_batch: bool = False


CASES = {
    "cpu": Case("cpu", None, (CPU_PATH,) * 3, (None,) * 3),
    "cuda-batch": Case("cuda", "cuda12_8", (None, CUDA_BATCH, CUDA_BATCH),
                       (None, "12.8", "12.8")),
    "cuda-no-batch-call": Case("cuda", "no_batch", (None, LOOP_PATH, LOOP_PATH),
                               (None, "12.4", "12.4")),
    "cuda-batch-not-supported": Case("cuda", "cuda12_8", (None, CUDA_BATCH, LOOP_PATH),
                                     (None, "12.8", "12.8"), refuse_batch=True),
    "npu-batch": Case("npu", "full", (BATCH_V2,) * 3, ("9.1.0",) * 3),
    "npu-no-batch-call": Case("npu", "none", (PER_COPY,) * 3, ("9.1.0",) * 3),
    "npu-batch-not-supported": Case("npu", "unsupported", (BATCH_V2, BATCH_V2, PER_COPY),
                                    ("9.1.0",) * 3),
}


@dataclass
class Harness:
    backend: DmaCopyBackend
    bind: Callable[[], BackendRig]
    refuse_batch: Callable[[], None]


def _cpu(case, fake_library, monkeypatch) -> Harness:
    backend = CpuCopyBackend()
    kv = torch.randint(0, 256, (2, 16, 64), dtype=torch.uint8, generator=torch.manual_seed(0))
    return Harness(backend, lambda: BackendRig(backend, [kv], 16, 16), lambda: None)


def _cuda(case, fake_library, monkeypatch) -> Harness:
    driver = FakeDriver(str(fake_library("cuda", case.variant)))
    driver.lib.fake_reset()
    backend = FakeGpuBackend("cuda:0", library_path=driver.path)
    return Harness(backend, lambda: cuda_rig(backend),
                   lambda: driver.lib.fake_fail_batch(CUDA_ERROR_NOT_SUPPORTED, SIZE_MAX, 0))


def _npu(case, fake_library, monkeypatch) -> Harness:
    from kvoffload_hal.backends.npu import NpuCopyBackend

    acl = FakeAcl(fake_library("npu", case.variant))
    monkeypatch.setattr(torch, "npu", FakeNpuModule(acl_calls=acl.total_calls), raising=False)
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu_module())
    monkeypatch.setenv(ACL_LIBRARY_ENV, str(acl.path))
    backend = NpuCopyBackend()
    kv = ascend_kv()
    for buf in kv.buffers:  # the fake checks which side of a copy each pointer is on
        acl.declare_device_memory(buf.data_ptr(), buf.numel(), 0)
    return Harness(backend, lambda: bind_rig(backend, kv), lambda: None)


@pytest.fixture(params=list(CASES))
def case(request) -> Case:
    return CASES[request.param]


@pytest.fixture
def harness(case, fake_library, monkeypatch):
    made = {"cpu": _cpu, "cuda": _cuda, "npu": _npu}[case.backend](case, fake_library,
                                                                   monkeypatch)
    rigs: list[BackendRig] = []
    bind = made.bind

    def bind_and_keep() -> BackendRig:
        rigs.append(bind())
        return rigs[-1]

    made.bind = bind_and_keep
    yield made
    for rig in rigs:
        rig.close()
    made.backend.shutdown(timeout_s=5.0)


def _observed(backend: DmaCopyBackend) -> tuple[str | None, str | None]:
    """``(copy_path, runtime_version)``, after checking what every backend must keep."""
    cls, path, version = type(backend), backend.copy_path, backend.runtime_version
    assert path is None or (isinstance(path, str) and path)
    assert backend.copy_path_is_fallback is (path in cls.fallback_copy_paths)
    assert version is None or (isinstance(version, str) and version)
    if cls.runtime_name is None:
        assert version is None, "a backend without a runtime reports no runtime version"
    return path, version


def test_copy_path_and_runtime_version_before_and_after_copies(case, harness):
    backend = harness.backend
    built = _observed(backend)
    rig = harness.bind()
    watch, ledger = CopyPathWatch(backend), StatsLedger()
    bound = _observed(backend)
    assert bound[0] is not None, "copy_path is known from bind on"
    if case.refuse_batch:
        harness.refuse_batch()
    backend.submit(TransferJob(0, Direction.STORE, [1, 2, 5], [0, 1, 3]))
    assert [r.ok for r in backend.flush()] == [True]
    backend.submit(TransferJob(0, Direction.LOAD, [0, 1, 3], [6, 7, 9]))
    assert [r.ok for r in backend.flush()] == [True]
    rig.assert_stored([1, 2, 5], [0, 1, 3])
    rig.assert_loaded([0, 1, 3], [6, 7, 9])
    watch.check(ledger)
    copied = _observed(backend)

    assert (built[0], bound[0], copied[0]) == case.paths
    assert (built[1], bound[1], copied[1]) == case.versions
    # The path changes at most once, and only to a per-copy fallback, which the worker's
    # watch counts once.
    switched = copied[0] != bound[0]
    assert not switched or (copied[0] in type(backend).fallback_copy_paths
                            and bound[0] not in type(backend).fallback_copy_paths)
    assert ledger.totals.reduce()["copy_path_fallbacks"] == int(switched)
    assert backend.copy_path_is_fallback is (case.paths[2] in (LOOP_PATH, PER_COPY))
