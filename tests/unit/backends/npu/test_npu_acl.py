"""The ctypes ACL bindings against the fake libascendcl: the ABI the C side sees, paths, chunks."""

from __future__ import annotations

import ctypes
import struct

import numpy as np
import pytest
from fake_acl import FakeAcl, host_buffers

from kvoffload_hal.backends.npu._acl import (
    ACL_LIBRARY_ENV,
    BATCH_V1,
    BATCH_V2,
    PER_COPY,
    AclError,
    AclMemcpyBatchAttr,
    AclRuntime,
    load_acl_library,
)


def _runtime(fake_libs, variant: str, **kwargs) -> tuple[AclRuntime, FakeAcl]:
    acl = FakeAcl(fake_libs[variant])
    return AclRuntime(ctypes.CDLL(str(acl.path)), **kwargs), acl


def test_attr_struct_is_32_bytes_on_both_sides(fake_libs):
    acl = FakeAcl(fake_libs["full"])
    assert ctypes.sizeof(AclMemcpyBatchAttr) == 32
    assert acl.attr_size() == 32
    assert AclMemcpyBatchAttr.dstLoc.offset == 0 and AclMemcpyBatchAttr.srcLoc.offset == 8


@pytest.mark.parametrize("to_device", [True, False])
def test_attr_bytes_seen_by_c(fake_libs, to_device):
    runtime, acl = _runtime(fake_libs, "full")
    src, dst, sp, dp, sizes = host_buffers(3, 64)
    runtime.memcpy_batch(dp, sp, sizes, to_device=to_device, device_id=5, stream=0x1234)
    # Raw layout: dstLoc {uint32 id, int type}, srcLoc {id, type}, 16 zero bytes.
    dst_id, dst_type, src_id, src_type = struct.unpack("<IiIi", acl.attr_bytes()[:16])
    assert acl.attr_bytes()[16:] == bytes(16)
    if to_device:  # host -> device: DEVICE=1 destination carries the device id
        assert (dst_id, dst_type, src_id, src_type) == (5, 1, 0, 0)
    else:
        assert (dst_id, dst_type, src_id, src_type) == (0, 0, 5, 1)
    assert acl.last_num_attrs() == 1 and acl.last_attr_index0() == 0
    assert acl.last_num_batches() == 3
    assert acl.last_stream() == 0x1234
    assert all((d == s).all() for d, s in zip(dst, src))


@pytest.mark.parametrize(("variant", "path"), [
    ("full", BATCH_V2), ("v2", BATCH_V2), ("v1", BATCH_V1), ("none", PER_COPY),
])
def test_symbol_order(fake_libs, variant, path):
    runtime, acl = _runtime(fake_libs, variant)
    assert runtime.path == path
    src, dst, sp, dp, sizes = host_buffers(5, 100, seed=1)
    calls = runtime.memcpy_batch(dp, sp, sizes, to_device=True, device_id=0, stream=7)
    assert all((d == s).all() for d, s in zip(dst, src))
    counts = (acl.v2_calls(), acl.v1_calls(), acl.copy_calls())
    expected = {BATCH_V2: (1, 0, 0), BATCH_V1: (0, 1, 0), PER_COPY: (0, 0, 5)}[path]
    assert counts == expected
    assert calls == (5 if path == PER_COPY else 1)


@pytest.mark.parametrize(("to_device", "kind"), [(True, 1), (False, 2)])
def test_per_copy_fallback_kind(fake_libs, to_device, kind):
    runtime, acl = _runtime(fake_libs, "none")
    src, dst, sp, dp, sizes = host_buffers(2, 8)
    runtime.memcpy_batch(dp, sp, sizes, to_device=to_device, device_id=0, stream=3)
    assert acl.last_kind() == kind and acl.last_stream() == 3


def test_chunking_at_max_descriptors(fake_libs):
    runtime, acl = _runtime(fake_libs, "full", max_batch_descriptors=4)
    src, dst, sp, dp, sizes = host_buffers(10, 32, seed=2)
    assert runtime.memcpy_batch(dp, sp, sizes, to_device=False, device_id=0, stream=1) == 3
    assert acl.v2_calls() == 3 and acl.max_num_batches() == 4 and acl.last_num_batches() == 2
    assert all((d == s).all() for d, s in zip(dst, src))


def test_fail_index_is_reported_with_chunk_offset(fake_libs):
    runtime, acl = _runtime(fake_libs, "failing", max_batch_descriptors=4)
    src, dst, sp, dp, sizes = host_buffers(6, 16)
    # The first chunk (4 copies) fails at its copy 2 -> descriptor 2 overall.
    with pytest.raises(AclError, match=r"failIndex 2\b"):
        runtime.memcpy_batch(dp, sp, sizes, to_device=True, device_id=0, stream=1)


@pytest.mark.parametrize("variant", ["full", "v1", "none"])
def test_failed_call_drains_the_stream_before_raising(fake_libs, variant):
    runtime, acl = _runtime(fake_libs, variant, max_batch_descriptors=4)
    src, dst, sp, dp, sizes = host_buffers(10, 16, seed=3)
    acl.fail_call(2, 507899)  # the second copy call fails; the first is already enqueued
    with pytest.raises(AclError, match="aclError 507899"):
        runtime.memcpy_batch(dp, sp, sizes, to_device=True, device_id=0, stream=0x77)
    assert (acl.sync_calls(), acl.sync_after_calls(), acl.last_sync_stream()) == (1, 1, 0x77)
    done = 1 if variant == "none" else 4  # copies made by the first call
    assert all((d == s).all() for d, s in zip(dst[:done], src[:done]))
    assert not any(d.any() for d in dst[done:])
    acl.fail_call(0, 0)
    runtime.memcpy_batch(dp, sp, sizes, to_device=True, device_id=0, stream=0x77)
    assert acl.sync_calls() == 1  # a successful job does not wait


def test_bad_pointer_is_reported_by_index_or_chunk(fake_libs):
    runtime, _ = _runtime(fake_libs, "v1")
    src, dst, sp, dp, sizes = host_buffers(2, 16)
    sp[1] = 0  # a null source is rejected, at its index
    with pytest.raises(AclError, match="failIndex 1"):
        runtime.memcpy_batch(dp, sp, sizes, to_device=True, device_id=0, stream=1)
    v2, _ = _runtime(fake_libs, "v2")  # V2 has no failIndex: the chunk start is named
    with pytest.raises(AclError, match=rf"{BATCH_V2} of 2 copies \(from descriptor 0\)"):
        v2.memcpy_batch(dp, sp, sizes, to_device=True, device_id=0, stream=1)


def _bad_attr(rsv0: int, src_type: int, dst_type: int):
    def make(to_device, device_id):
        attr = AclMemcpyBatchAttr()
        attr.rsv[0] = rsv0
        attr.srcLoc.type, attr.dstLoc.type = src_type, dst_type
        return attr
    return staticmethod(make)


def test_attribute_errors(fake_libs, monkeypatch):
    runtime, _ = _runtime(fake_libs, "v1")
    src, dst, sp, dp, sizes = host_buffers(2, 16)
    # host -> host is not a batch direction: reported at the attribute's first copy.
    monkeypatch.setattr(AclRuntime, "_attr", _bad_attr(0, 0, 0))
    with pytest.raises(AclError, match="failIndex 0"):
        runtime.memcpy_batch(dp, sp, sizes, to_device=True, device_id=0, stream=1)
    # Non-zero reserved bytes: an error tied to no copy (failIndex = SIZE_MAX).
    monkeypatch.setattr(AclRuntime, "_attr", _bad_attr(1, 0, 1))
    with pytest.raises(AclError, match="not tied to one copy"):
        runtime.memcpy_batch(dp, sp, sizes, to_device=True, device_id=0, stream=1)


def test_per_copy_error_names_descriptor(fake_libs):
    runtime, _ = _runtime(fake_libs, "none")
    src, dst, sp, dp, sizes = host_buffers(3, 16)
    dp[2] = 0
    with pytest.raises(AclError, match="descriptor 2"):
        runtime.memcpy_batch(dp, sp, sizes, to_device=False, device_id=0, stream=1)


def test_argument_checks(fake_libs):
    with pytest.raises(ValueError, match="positive"):
        _runtime(fake_libs, "full", max_batch_descriptors=0)
    runtime, _ = _runtime(fake_libs, "full")
    with pytest.raises(ValueError, match="differ in length"):
        runtime.memcpy_batch(np.zeros(2, np.uint64), np.zeros(1, np.uint64), np.zeros(2, np.uint64),
                             to_device=True, device_id=0, stream=1)


def test_malloc_and_free_host(fake_libs):
    runtime, acl = _runtime(fake_libs, "full")
    before = acl.live_host_allocs()  # process-wide in the fake: compare deltas
    ptr = runtime.malloc_host(4096)
    assert ptr % 64 == 0 and acl.live_host_allocs() == before + 1
    runtime.free_host(ptr)
    assert acl.live_host_allocs() == before
    with pytest.raises(AclError, match="aclrtMallocHost"):
        runtime.malloc_host(0)
    with pytest.raises(AclError, match="aclrtFreeHost"):
        runtime.free_host(0)


def test_loader_honours_env(fake_libs, monkeypatch):
    monkeypatch.setenv(ACL_LIBRARY_ENV, str(fake_libs["v1"]))
    assert hasattr(load_acl_library(), "aclrtMemcpyBatchAsync")
    monkeypatch.setenv(ACL_LIBRARY_ENV, "/nonexistent/libascendcl.so")
    with pytest.raises(OSError):
        load_acl_library()
