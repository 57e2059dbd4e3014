"""NpuCopyBackend end to end on the fake runtime: bytes, paths, fences, failures, host memory."""

from __future__ import annotations

import logging
import sys
import threading

import numpy as np
import pytest
import torch
from ascend_kv import NUM_HOST_BLOCKS, AscendKv, bind_rig
from fake_torch_npu import FakeEvent

from kvoffload_hal import logger as package_logger
from kvoffload_hal.backends.npu import NpuCopyBackend
from kvoffload_hal.backends.npu import backend as npu_backend
from kvoffload_hal.backends.npu._acl import ACL_LIBRARY_ENV, BATCH_V1, BATCH_V2, PER_COPY
from kvoffload_hal.hal.backend import Direction, TransferJob
from support.polling import collect_results


@pytest.mark.parametrize(("variant", "path", "max_desc"), [
    ("full", BATCH_V2, 8192), ("v1", BATCH_V1, 8192), ("none", PER_COPY, 8192),
    ("v2", BATCH_V2, 3),
])
def test_random_round_trips_byte_for_byte(npu_env, kv: AscendKv, variant, path, max_desc):
    backend = npu_env.backend(variant, max_batch_descriptors=max_desc)
    assert backend.copy_path == path
    rig = bind_rig(backend, kv)
    rng = np.random.default_rng(1234)
    job_id = 0
    for _ in range(4):
        k = int(rng.integers(1, 12))
        src = rng.choice(kv.num_blocks, k, replace=False)
        dst = rng.choice(NUM_HOST_BLOCKS, k, replace=False)
        if rng.random() < 0.5:  # also exercise merged runs of consecutive blocks
            src, dst = np.sort(src), np.arange(k) + int(rng.integers(0, NUM_HOST_BLOCKS - k))
        expected = {(i, int(d)): kv.block(i, int(s)) for i in range(len(kv.tensors))
                    for s, d in zip(src, dst)}
        backend.submit(TransferJob(job_id, Direction.STORE, src, dst, tag=("store", job_id)))
        [result] = collect_results(backend.poll, 1)
        assert result.ok and result.tag == ("store", job_id)
        assert result.num_bytes == k * sum(r.block_bytes for r in rig.host_regions)
        for (i, d), data in expected.items():
            assert rig.host_block(i, d).numpy().tobytes() == data

        # Load the same host blocks back into other device blocks.
        load_dst = rng.choice(kv.num_blocks, k, replace=False)
        backend.submit(TransferJob(job_id, Direction.LOAD, dst, load_dst))
        [result] = backend.flush()
        assert result.ok and result.direction is Direction.LOAD
        rig.assert_loaded(dst, load_dst)
        job_id += 1
    assert backend.num_pending == 0


def test_every_job_waits_on_a_compute_event_before_its_batch(npu_env, kv):
    backend = npu_env.backend("full")
    bind_rig(backend, kv)
    store_stream, load_stream = backend._streams[Direction.STORE], backend._streams[Direction.LOAD]
    assert store_stream.npu_stream != load_stream.npu_stream
    backend.submit(TransferJob(0, Direction.LOAD, [0, 1], [3, 4]))
    load_fence = npu_env.npu.events[-1]
    backend.flush()
    assert npu_env.acl.last_stream() == load_stream.npu_stream
    # A load waits too: compute enqueued earlier may still read its destination.
    assert [e for e in load_stream.log if e[0] == "wait"] == [("wait", load_fence.handle, 0)]

    backend.submit(TransferJob(0, Direction.STORE, [5, 9], [1, 2]))
    # The fence is recorded on the compute stream in the engine thread, at submit.
    fence = npu_env.npu.events[-1]
    assert fence is not load_fence
    assert fence.recorded_on is npu_env.npu.compute_stream and not fence.enable_timing
    backend.flush()
    waits = [e for e in store_stream.log if e[0] == "wait"]
    # The wait happened after the load's batch (1 ACL call) and before the store's.
    assert waits == [("wait", fence.handle, 1)]
    assert npu_env.acl.total_calls() == 2
    assert npu_env.acl.last_stream() == store_stream.npu_stream


def test_a_forward_end_fence_is_one_event_both_copy_streams_wait_on(npu_env, kv):
    """Where vLLM says the forward pass is enqueued (finish_forward), the step's jobs
    wait on the event recorded then instead of recording their own."""
    backend = npu_env.backend("full")
    bind_rig(backend, kv)
    backend.forward_done()
    fence = npu_env.npu.events[-1]
    assert fence.recorded_on is npu_env.npu.compute_stream
    backend.submit(TransferJob(0, Direction.STORE, [5, 9], [1, 2]))
    backend.submit(TransferJob(0, Direction.LOAD, [0, 1], [3, 4]))
    assert all(r.ok for r in backend.flush())

    def compute_fences():
        return [e for e in npu_env.npu.events if e.recorded_on is npu_env.npu.compute_stream]

    assert compute_fences() == [fence]  # no event of their own
    for stream in backend._streams.values():
        # Waited on before any copy call of the step (0 ACL calls made then).
        assert [e for e in stream.log if e[0] == "wait"] == [("wait", fence.handle, 0)]
    backend.step_done()
    backend.submit(TransferJob(1, Direction.STORE, [6], [3]))
    assert backend.flush()[0].ok
    assert len(compute_fences()) == 2  # the next step's job: its own fence again


def test_copy_thread_binds_device_and_device_index_reaches_attrs(npu_env, kv):
    backend = npu_env.backend("full", device=torch.device("privateuseone", 1))
    bind_rig(backend, kv)
    backend.submit(TransferJob(0, Direction.STORE, [0], [0]))
    backend.submit(TransferJob(1, Direction.STORE, [1], [1]))
    backend.flush()
    assert npu_env.npu.set_device_calls == [(1, "kvoffload-npu")]  # once, in the copy thread
    assert npu_env.acl.attr_bytes()[8:12] == (1).to_bytes(4, "little")  # srcLoc.id = device 1


def test_fail_index_fails_the_job_and_the_next_job_still_runs(npu_env, kv):
    backend = npu_env.backend("failing")
    rig = bind_rig(backend, kv)
    # Non-consecutive ids: 3 blocks x 4 tensors = 12 descriptors, failing at 2.
    backend.submit(TransferJob(0, Direction.LOAD, [0, 2, 4], [1, 3, 5], tag="req-1"))
    [failed] = backend.flush()
    assert not failed.ok and failed.tag == "req-1" and failed.num_bytes == 0
    assert "failIndex 2" in failed.error
    backend.submit(TransferJob(1, Direction.STORE, [7], [8]))  # 1 block x 4 tensors: still > 2
    [second] = backend.flush()
    assert not second.ok
    npu_env.monkeypatch.setattr(backend._acl, "max_batch_descriptors", 2)
    backend.submit(TransferJob(2, Direction.STORE, [7], [8]))  # chunks of 2 never reach index 2
    [third] = backend.flush()
    assert third.ok
    rig.assert_stored([7], [8])


def test_runtime_error_on_query_fails_the_job(npu_env, kv):
    backend = npu_env.backend("full")
    bind_rig(backend, kv)
    npu_env.npu.fail_query = True
    backend.submit(TransferJob(0, Direction.STORE, [0], [0], tag="t"))
    [result] = collect_results(backend.poll, 1)
    assert not result.ok and "507011" in result.error and result.tag == "t"


def test_elapsed_time_comes_from_npu_events(npu_env, kv, monkeypatch):
    backend = npu_env.backend("full")
    bind_rig(backend, kv)
    backend.submit(TransferJob(0, Direction.STORE, [0], [0]))
    [result] = backend.flush()
    assert result.seconds == pytest.approx(2.5e-3)

    def broken(self, end):
        raise RuntimeError("timing unavailable")

    monkeypatch.setattr(FakeEvent, "elapsed_time", broken)
    backend.submit(TransferJob(1, Direction.STORE, [1], [1]))
    [result] = backend.flush()
    assert result.ok and 0 <= result.seconds < 5


def test_max_descriptors_from_environment(npu_env, kv, monkeypatch):
    monkeypatch.setenv(npu_backend.MAX_DESCRIPTORS_ENV, "2")
    backend = npu_env.backend("full")
    bind_rig(backend, kv)
    backend.submit(TransferJob(0, Direction.STORE, [0, 2], [0, 2]))  # 2 blocks x 4 tensors
    backend.flush()
    assert npu_env.acl.v2_calls() == 4 and npu_env.acl.max_num_batches() == 2


@pytest.mark.parametrize("raw", ["many", "1.5", "0", "-3"])
def test_bad_max_descriptors_env_var_is_named(npu_env, monkeypatch, raw):
    monkeypatch.setenv(npu_backend.MAX_DESCRIPTORS_ENV, raw)
    with pytest.raises(ValueError) as info:
        npu_env.backend("full")
    message = str(info.value)
    assert message.startswith(f"KVOFFLOAD_HAL_NPU_MAX_BATCH_DESCRIPTORS={raw!r}")
    assert "an integer >= 1" in message and "\n" not in message


@pytest.mark.parametrize("variant", ["full", "v1", "none"])
def test_failed_call_waits_for_the_calls_already_enqueued(npu_env, kv, variant):
    backend = npu_env.backend(variant, max_batch_descriptors=4)
    rig = bind_rig(backend, kv)
    # 3 separate blocks x 4 tensors = 12 descriptors: 3 batch calls of 4 (12 per-copy calls).
    npu_env.acl.fail_call(2, 507899)  # the second ACL copy call fails
    backend.submit(TransferJob(0, Direction.STORE, [0, 2, 4], [1, 3, 5], tag="t"))
    [failed] = backend.flush()
    assert not failed.ok and failed.tag == "t" and "aclError 507899" in failed.error
    # The copy stream was synchronized after the first call, before the job was reported.
    acl = npu_env.acl
    assert (acl.sync_calls(), acl.sync_after_calls()) == (1, 1)
    assert acl.last_sync_stream() == backend._streams[Direction.STORE].npu_stream
    backend.submit(TransferJob(1, Direction.STORE, [6], [7]))  # the backend keeps working
    assert backend.flush()[0].ok and acl.sync_calls() == 1  # no wait after a success
    rig.assert_stored([6], [7])


def test_host_memory_comes_from_acl_malloc_host(npu_env):
    backend = npu_env.backend("full")
    live = npu_env.acl.live_host_allocs  # process-wide count in the fake: compare deltas
    before = live()
    host = backend.allocate_host(1 << 20)
    assert host.dtype == torch.uint8 and host.shape == (1 << 20,) and host.data_ptr() % 64 == 0
    assert live() == before + 1
    host.fill_(7)  # writable
    with pytest.raises(ValueError, match="not allocated by this backend"):
        backend.free_host(torch.empty(8, dtype=torch.uint8))
    backend.free_host(host)
    assert live() == before
    with pytest.raises(ValueError, match="positive"):
        backend.allocate_host(0)


def test_shutdown_is_idempotent_and_keeps_host_memory(npu_env, kv):
    backend = npu_env.backend("full")
    before = npu_env.acl.live_host_allocs()
    rig = bind_rig(backend, kv)
    copy_streams = list(backend._streams.values())
    assert len(copy_streams) == 2
    assert backend.shutdown() is True
    backend.shutdown()
    assert backend._streams == {}
    for stream in copy_streams:  # drained before the caller frees the host memory
        assert [e for e in stream.log if e[0] == "synchronize"]
    assert npu_env.acl.live_host_allocs() == before + 1  # the caller frees it, after shutdown
    backend.free_host(rig.host)
    assert npu_env.acl.live_host_allocs() == before


def test_copy_path_is_logged_once(npu_env, caplog, monkeypatch):
    monkeypatch.setattr(package_logger, "_logged_messages", set())
    logging.getLogger(npu_backend.__name__).propagate = True
    with caplog.at_level(logging.INFO, logger=npu_backend.__name__):
        npu_env.backend("none")
        npu_env.backend("none")
        npu_env.backend("v1")
    fallback = [r for r in caplog.records if "falling back" in r.getMessage()]
    assert len(fallback) == 1 and fallback[0].levelno == logging.WARNING
    assert any(BATCH_V1 in r.getMessage() for r in caplog.records)


class TestUnavailableReason:
    def test_available_on_the_fake_runtime(self, npu_env):
        assert NpuCopyBackend.unavailable_reason() is None

    def test_no_torch_npu(self, npu_env, monkeypatch):
        monkeypatch.setitem(sys.modules, "torch_npu", None)
        assert NpuCopyBackend.unavailable_reason() == "torch_npu is not importable"

    def test_spec_less_torch_npu_module(self, npu_env, monkeypatch):
        import types

        # A module whose __spec__ is None.
        monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
        assert NpuCopyBackend.unavailable_reason() == "torch_npu is not importable"

    def test_no_library(self, npu_env, monkeypatch):
        monkeypatch.setenv(ACL_LIBRARY_ENV, "/nonexistent/libascendcl.so")
        reason = NpuCopyBackend.unavailable_reason()
        assert reason.startswith("libascendcl.so cannot be loaded: ") and "\n" not in reason

    def test_no_device(self, npu_env):
        npu_env.npu.available = False
        assert NpuCopyBackend.unavailable_reason() == "no NPU is visible"

    def test_broken_torch_npu(self, npu_env, monkeypatch):
        def boom():
            raise RuntimeError("ERR00008 PTA resource not found\nsource set_env.sh")

        monkeypatch.setattr(npu_env.npu, "is_available", boom)
        reason = NpuCopyBackend.unavailable_reason()
        assert reason.startswith("torch_npu is not importable: RuntimeError") and "\n" not in reason

    def test_probe_starts_no_thread_and_touches_no_device(self, npu_env):
        threads = threading.active_count()
        NpuCopyBackend.unavailable_reason()
        assert threading.active_count() == threads
        assert npu_env.npu.set_device_calls == [] and len(npu_env.npu.streams) == 1
