"""Chips without batch copy, and the fake runtime rejecting what ACL rejects.

On Atlas training 910, Atlas inference 310P and Atlas 200I/500 A2 every CANN >=
8.3 exports the batch symbols, but the calls answer
ACL_ERROR_RT_FEATURE_NOT_SUPPORT (207000). The fake's ``unsupported`` variants
do the same; the backend must then copy every byte with the per-copy loop.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import pytest
from ascend_kv import NUM_HOST_BLOCKS, AscendKv, bind_rig
from fake_acl import FakeAcl, host_buffers

from kvoffload_hal import logger as package_logger
from kvoffload_hal.backends.npu._acl import (
    ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
    BATCH_V1,
    BATCH_V2,
    PER_COPY,
    AclError,
    AclMemcpyBatchAttr,
    AclRuntime,
)
from kvoffload_hal.hal.backend import Direction, TransferJob
from kvoffload_hal.metrics import CopyPathWatch, StatsLedger
from support.polling import collect_results

ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_RT_PARAM_INVALID = 107000


@pytest.mark.parametrize(("variant", "first_path"),
                         [("unsupported", BATCH_V2), ("unsupported_v1", BATCH_V1)])
def test_feature_not_supported_switches_to_the_loop_for_good(fake_libs, monkeypatch, caplog,
                                                             variant, first_path):
    monkeypatch.setattr(package_logger, "_logged_messages", set())
    acl = FakeAcl(fake_libs[variant])
    runtime = AclRuntime(ctypes.CDLL(str(acl.path)), max_batch_descriptors=4)
    assert runtime.path == first_path and runtime.fallbacks == 0
    src, dst, sp, dp, sizes = host_buffers(10, 96, seed=5)
    with caplog.at_level(logging.WARNING):
        calls = runtime.memcpy_batch(dp, sp, sizes, to_device=True, device_id=0, stream=9)
        # The first chunk's rejected descriptors are copied too, by the loop.
        assert all(d.tobytes() == s.tobytes() for d, s in zip(dst, src))
        assert calls == 10 and acl.copy_calls() == 10 and acl.last_stream() == 9
        assert acl.unsupported_calls() == 1 and acl.sync_calls() == 0  # not a failed job
        assert runtime.path == PER_COPY and runtime.fallbacks == 1
        back = [np.zeros(96, dtype=np.uint8) for _ in range(10)]
        back_ptrs = np.array([b.ctypes.data for b in back], dtype=np.uint64)
        runtime.memcpy_batch(back_ptrs, dp, sizes, to_device=False, device_id=0, stream=9)
    assert all(b.tobytes() == s.tobytes() for b, s in zip(back, src))
    assert acl.unsupported_calls() == 1  # never asked again
    assert acl.last_kind() == 2 and runtime.fallbacks == 1
    warnings = [r.getMessage() for r in caplog.records if "FEATURE_NOT_SUPPORT" in r.getMessage()]
    assert len(warnings) == 1 and str(ACL_ERROR_RT_FEATURE_NOT_SUPPORT) in warnings[0]
    assert first_path in warnings[0]


def _declare_kv_as_device_memory(acl: FakeAcl, kv: AscendKv, device: int = 0) -> None:
    for buf in kv.buffers:
        acl.declare_device_memory(buf.data_ptr(), buf.numel(), device)


def test_backend_on_a_chip_without_batch_copy_round_trips_byte_for_byte(npu_env, kv):
    backend = npu_env.backend("unsupported", max_batch_descriptors=5)
    _declare_kv_as_device_memory(npu_env.acl, kv)  # the fake checks every pointer's side
    rig = bind_rig(backend, kv)
    watch, ledger = CopyPathWatch(backend), StatsLedger()
    assert backend.copy_path == BATCH_V2
    rng = np.random.default_rng(7)
    for job_id in range(3):
        src = rng.choice(kv.num_blocks, 9, replace=False)
        dst = rng.choice(NUM_HOST_BLOCKS, 9, replace=False)
        expected = {(i, int(d)): kv.block(i, int(s)) for i in range(len(kv.tensors))
                    for s, d in zip(src, dst)}
        backend.submit(TransferJob(job_id, Direction.STORE, src, dst))
        [result] = collect_results(backend.poll, 1)
        assert result.ok, result.error
        for (i, d), data in expected.items():
            assert rig.host_block(i, d).numpy().tobytes() == data
        load_dst = rng.choice(kv.num_blocks, 9, replace=False)
        backend.submit(TransferJob(job_id, Direction.LOAD, dst, load_dst))
        [result] = backend.flush()
        assert result.ok, result.error
        rig.assert_loaded(dst, load_dst)
        watch.check(ledger)
    assert backend.copy_path == PER_COPY
    assert npu_env.acl.unsupported_calls() == 1
    assert ledger.totals.reduce()["copy_path_fallbacks"] == 1  # counted once, not per job


# ------------------------------------------------------ the fake is as strict as ACL
def _raw_batch(acl: FakeAcl, dsts, srcs, sizes, dest_maxs, attr: AclMemcpyBatchAttr):
    """The fake's aclrtMemcpyBatchAsync called directly; returns (aclError, failIndex)."""
    n = len(sizes)
    arr = lambda vals: (ctypes.c_size_t * n)(*vals)  # noqa: E731
    fail = ctypes.c_size_t(0)
    fn = acl.lib.aclrtMemcpyBatchAsync
    fn.restype = ctypes.c_int
    ret = fn(arr(dsts), arr(dest_maxs), arr(srcs), arr(sizes), ctypes.c_size_t(n),
             ctypes.byref(attr), (ctypes.c_size_t * 1)(0), ctypes.c_size_t(1),
             ctypes.byref(fail), ctypes.c_void_p(1))
    return ret, fail.value


def _attr(dst_type: int, dst_id: int, src_type: int, src_id: int) -> AclMemcpyBatchAttr:
    attr = AclMemcpyBatchAttr()
    attr.dstLoc.type, attr.dstLoc.id = dst_type, dst_id
    attr.srcLoc.type, attr.srcLoc.id = src_type, src_id
    return attr


H2D = (1, 0, 0, 0)  # dst DEVICE 0, src HOST


@pytest.mark.parametrize(("case", "expected"), [
    ("size zero", (ACL_ERROR_INVALID_PARAM, 1)),
    ("size above destMax", (ACL_ERROR_INVALID_PARAM, 1)),
    ("device id not the pointer's", (ACL_ERROR_RT_PARAM_INVALID, 0)),
    ("host to host attribute", (ACL_ERROR_RT_PARAM_INVALID, 0)),
    ("host pointer on the device side", (ACL_ERROR_RT_PARAM_INVALID, 1)),
    ("device pointer on the host side", (ACL_ERROR_RT_PARAM_INVALID, 0)),
])
def test_fake_batch_rejects_what_acl_rejects(fake_libs, case, expected):
    acl = FakeAcl(fake_libs["v1"])
    device = np.zeros(4096, dtype=np.uint8)
    host = np.arange(4096, dtype=np.uint32).astype(np.uint8)
    acl.declare_device_memory(device.ctypes.data, device.nbytes, 0)
    dsts = [device.ctypes.data, device.ctypes.data + 2048]
    srcs = [host.ctypes.data, host.ctypes.data + 2048]
    sizes, dest_maxs, attr = [64, 64], [64, 64], _attr(*H2D)
    if case == "size zero":
        sizes = [64, 0]
    elif case == "size above destMax":
        dest_maxs = [64, 63]
    elif case == "device id not the pointer's":
        attr = _attr(1, 1, 0, 0)
    elif case == "host to host attribute":
        attr = _attr(0, 0, 0, 0)
    elif case == "host pointer on the device side":
        dsts[1] = host.ctypes.data + 1024
    else:
        srcs[0] = device.ctypes.data + 1024
    assert _raw_batch(acl, dsts, srcs, sizes, dest_maxs, attr) == expected
    assert not device.any()  # a rejected batch copies nothing
    valid = _raw_batch(acl, [device.ctypes.data], [host.ctypes.data], [64], [64], _attr(*H2D))
    assert valid == (0, 2**64 - 1)
    assert device[:64].tobytes() == host[:64].tobytes()


def test_runtime_names_the_device_of_its_pointers(fake_libs):
    """Through the production code: the attribute's device id must be the memory's."""
    acl = FakeAcl(fake_libs["v1"])
    runtime = AclRuntime(ctypes.CDLL(str(acl.path)))
    src, dst, sp, dp, sizes = host_buffers(3, 32, seed=8)
    for d in dst:
        acl.declare_device_memory(d.ctypes.data, d.nbytes, 1)
    with pytest.raises(AclError, match="aclError 107000 .failIndex 0"):
        runtime.memcpy_batch(dp, sp, sizes, to_device=True, device_id=0, stream=1)
    runtime.memcpy_batch(dp, sp, sizes, to_device=True, device_id=1, stream=1)
    assert all(d.tobytes() == s.tobytes() for d, s in zip(dst, src))
    with pytest.raises(AclError, match="failIndex 0"):  # the direction is part of it too
        runtime.memcpy_batch(sp, dp, sizes, to_device=True, device_id=1, stream=1)


def test_fake_per_copy_rejects_a_kind_its_pointers_contradict(fake_libs):
    acl = FakeAcl(fake_libs["none"])
    runtime = AclRuntime(ctypes.CDLL(str(acl.path)))
    src, dst, sp, dp, sizes = host_buffers(2, 32, seed=9)
    for d in dst:
        acl.declare_device_memory(d.ctypes.data, d.nbytes, 0)
    with pytest.raises(AclError, match="descriptor 0 .* aclError 107000"):
        runtime.memcpy_batch(dp, sp, sizes, to_device=False, device_id=0, stream=1)
    runtime.memcpy_batch(dp, sp, sizes, to_device=True, device_id=0, stream=1)
    assert all(d.tobytes() == s.tobytes() for d, s in zip(dst, src))
