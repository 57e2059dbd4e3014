"""Store fences, copy streams, registered host memory and the backend's lifecycle."""

from __future__ import annotations

import ctypes
import mmap
import threading

import numpy as np
import pytest
import torch
from cuda_fake import FakeGpuBackend

from kvoffload_hal.backends.cuda._driver import CU_STREAM_NON_BLOCKING, CudaError
from kvoffload_hal.hal.backend import Direction, TransferJob

PAGE = mmap.PAGESIZE


def test_store_waits_on_an_event_recorded_on_the_compute_stream(fake, make_setup):
    setup = make_setup()
    backend = setup.backend
    backend.compute_stream = compute = fake.create_stream()
    fake.lib.fake_set_defer(1)  # streams run only when something waits on them
    # "Compute" still pending on its stream: it overwrites device block 6.
    new_values = torch.full((setup.kv.shape[2],), 0xAB, dtype=torch.uint8)
    for region in setup.device_regions:
        fake.memcpy_async(region.base_ptr + 6 * region.block_stride_bytes,
                          new_values.data_ptr(), region.block_bytes, compute)
    backend.submit(TransferJob(0, Direction.STORE, [6], [2]))
    (result,) = backend.flush()  # synchronises the store's event only
    assert result.ok
    assert (setup.host_view[:, 2] == 0xAB).all(), "the store read KV before compute wrote it"

    log = fake.log()
    store_stream = backend._streams[Direction.STORE]
    (fence,) = [e for f, s, e in log if f == "cuEventRecord" and s == compute]
    waits = [i for i, (f, s, e) in enumerate(log) if f == "cuStreamWaitEvent"]
    batch = next(i for i, (f, s, _) in enumerate(log) if f == "cuMemcpyBatchAsync")
    assert len(waits) == 1 and log[waits[0]][1:] == (store_stream, fence)
    assert waits[0] < batch and log[batch][1] == store_stream
    assert ("cuEventDestroy_v2", 0, fence) in log  # the fence does not leak


def test_a_fence_at_the_forward_end_orders_the_steps_copies_after_that_pass_only(
        fake, make_setup):
    """vLLM 0.33 says when the forward pass is enqueued (finish_forward); the step's
    copies, submitted after the sampler, then wait for that pass, not for the sampler."""
    setup = make_setup()
    backend = setup.backend
    backend.compute_stream = compute = fake.create_stream()
    fake.lib.fake_set_defer(1)  # streams run only when something waits on them
    sources = []

    def compute_writes(block, value):
        sources.append(torch.full((setup.kv.shape[2],), value, dtype=torch.uint8))
        for region in setup.device_regions:
            fake.memcpy_async(region.base_ptr + block * region.block_stride_bytes,
                              sources[-1].data_ptr(), region.block_bytes, compute)

    compute_writes(6, 0xAB)  # the forward pass
    backend.forward_done()
    compute_writes(6, 0xCD)  # work enqueued after it (the sampler's place)
    backend.submit(TransferJob(0, Direction.STORE, [6], [2]))
    backend.submit(TransferJob(0, Direction.LOAD, [0], [9]))
    assert all(r.ok for r in backend.flush())
    assert (setup.host_view[:, 2] == 0xAB).all()  # after the forward pass, not after more

    log = fake.log()
    (fence,) = [e for f, s, e in log if f == "cuEventRecord" and s == compute]
    waits = {s for f, s, e in log if f == "cuStreamWaitEvent" and e == fence}
    assert waits == set(backend._streams.values())  # both copy streams, one event
    assert fake.calls("cuStreamWaitEvent") == 2 and ("cuEventDestroy_v2", 0, fence) in log

    backend.step_done()  # the next step's jobs fence at their submission again
    backend.submit(TransferJob(1, Direction.STORE, [6], [3]))
    assert backend.flush()[0].ok
    assert (setup.host_view[:, 3] == 0xCD).all()


def test_loads_wait_on_the_compute_fence_too(fake, make_setup):
    # A load may target a block that compute enqueued earlier still reads
    # (write-after-read): it waits on the compute stream like a store.
    setup = make_setup()
    setup.backend.submit(TransferJob(0, Direction.LOAD, [0, 1], [2, 3]))
    assert setup.backend.flush()[0].ok
    assert fake.calls("cuStreamWaitEvent") == 1
    assert fake.calls("cuEventRecord") == 2  # compute fence + completion event


def test_fence_failure_fails_the_store_not_the_engine(fake, make_setup):
    setup = make_setup()

    def broken() -> int:
        raise RuntimeError("no current stream")

    setup.backend._compute_stream_handle = broken
    setup.backend.submit(TransferJob(0, Direction.STORE, [0], [0]))  # must not raise
    setup.backend.submit(TransferJob(0, Direction.LOAD, [0], [1]))
    results = setup.backend.flush()
    assert len(results) == 2 and not any(r.ok for r in results)
    assert all("could not record the compute fence: no current stream" in r.error
               for r in results)


def test_fence_record_error_fails_the_store(fake, make_setup):
    setup = make_setup()
    setup.backend.compute_stream = stale = fake.create_stream()
    assert fake.lib.cuStreamDestroy_v2(ctypes.c_void_p(stale)) == 0
    events_before = fake.lib.fake_live_events()
    setup.backend.submit(TransferJob(0, Direction.STORE, [0], [0]))
    (result,) = setup.backend.flush()
    assert not result.ok
    assert "cuEventRecord failed: CUDA_ERROR_INVALID_HANDLE" in result.error
    assert fake.lib.fake_live_events() == events_before  # the unrecorded fence was destroyed


def test_copy_streams_are_lowest_priority_and_non_blocking(fake, make_setup):
    fake.lib.fake_set_priority_range(0, -5)
    setup = make_setup()
    streams = setup.backend._streams
    assert len(set(streams.values())) == 2 and 0 not in streams.values()
    for stream in streams.values():
        assert fake.lib.fake_stream_priority(stream) == 0  # "least" = lowest priority
        assert fake.lib.fake_stream_flags(stream) == CU_STREAM_NON_BLOCKING
    assert fake.calls("cuCtxGetStreamPriorityRange") == 1


def test_copy_streams_use_the_least_priority_reported(fake, make_setup):
    fake.lib.fake_set_priority_range(3, -2)  # unusual range: least is not 0
    setup = make_setup()
    for stream in setup.backend._streams.values():
        assert fake.lib.fake_stream_priority(stream) == 3


def test_host_memory_is_registered_in_page_aligned_chunks(fake):
    backend = FakeGpuBackend("cuda:0", library_path=fake.path, register_chunk_bytes=2 * PAGE)
    num_bytes = 5 * PAGE + 100
    host = backend.allocate_host(num_bytes)
    assert host.dtype == torch.uint8 and host.dim() == 1 and host.numel() == num_bytes
    assert host.data_ptr() % PAGE == 0
    regs = fake.registrations()
    assert [(r.ptr - host.data_ptr(), r.size) for r in regs] == [
        (0, 2 * PAGE), (2 * PAGE, 2 * PAGE), (4 * PAGE, PAGE + 100)]
    host.fill_(7)  # the whole range is usable memory
    backend.free_host(host)
    assert fake.calls("cuMemHostUnregister") == 3
    assert not any(r.registered for r in fake.registrations())
    with pytest.raises(ValueError, match="not returned by allocate_host"):
        backend.free_host(host)


def test_failed_registration_unregisters_the_chunks_already_done(fake):
    backend = FakeGpuBackend("cuda:0", library_path=fake.path, register_chunk_bytes=PAGE)
    fake.lib.fake_fail_register(2, 2)  # CUDA_ERROR_OUT_OF_MEMORY on the third chunk
    with pytest.raises(CudaError, match=r"cuMemHostRegister failed: .* \(2\)"):
        backend.allocate_host(4 * PAGE)
    regs = fake.registrations()
    assert len(regs) == 2 and not any(r.registered for r in regs)


def test_host_allocation_arguments_are_checked(fake):
    with pytest.raises(ValueError, match="multiple of the page size"):
        FakeGpuBackend("cuda:0", library_path=fake.path,
                       register_chunk_bytes=PAGE + 1).allocate_host(PAGE)
    backend = FakeGpuBackend("cuda:0", library_path=fake.path)
    with pytest.raises(ValueError, match="no host memory was allocated"):
        backend.free_host(torch.empty(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must be positive"):
        backend.allocate_host(0)


def test_unregister_error_is_raised_after_trying_every_chunk(fake):
    backend = FakeGpuBackend("cuda:0", library_path=fake.path, register_chunk_bytes=PAGE)
    host = backend.allocate_host(3 * PAGE)
    first = fake.registrations()[0].ptr
    assert fake.lib.cuMemHostUnregister(ctypes.c_void_p(first)) == 0  # someone else unregistered it
    with pytest.raises(CudaError, match="CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"):
        backend.free_host(host)
    assert fake.calls("cuMemHostUnregister") == 1 + 3
    assert not any(r.registered for r in fake.registrations())


def test_shutdown_releases_streams_events_and_context(fake, make_setup):
    setup = make_setup()
    backend = setup.backend
    backend.submit(TransferJob(0, Direction.STORE, [0, 1], [0, 1]))
    assert backend.flush()[0].ok
    assert fake.lib.fake_live_streams() == 2 and fake.lib.fake_ctx_refcount(0) == 1
    backend.shutdown()
    backend.shutdown()  # idempotent
    assert fake.lib.fake_live_streams() == 0 and fake.lib.fake_live_events() == 0
    assert fake.lib.fake_ctx_refcount(0) == 1  # host memory still registered needs it
    backend.free_host(setup.host)
    assert fake.lib.fake_ctx_refcount(0) == 0
    with pytest.raises(RuntimeError, match="shut down"):
        backend.submit(TransferJob(1, Direction.STORE, [0], [0]))


def test_shutdown_waits_for_queued_copies_before_streams_and_host_memory_go(fake, make_setup):
    setup = make_setup()
    backend = setup.backend
    fake.lib.fake_set_defer(1)  # copies stay queued on their streams until waited for
    setup.host_view.zero_()
    backend.submit(TransferJob(0, Direction.STORE, [4], [1]))
    backend.poll()  # launched, not finished
    assert backend.shutdown() is True
    log = [(f, s) for f, s, _ in fake.log()]
    streams = list(dict.fromkeys(s for f, s in log if f == "cuStreamDestroy_v2"))
    assert len(streams) == 2
    for stream in streams:
        assert log.index(("cuStreamSynchronize", stream)) < log.index(
            ("cuStreamDestroy_v2", stream))
    assert (setup.host_view[:, 1] == setup.kv[:, 4]).all()  # the copy ended before free_host
    backend.free_host(setup.host)


def test_shutdown_before_bind_touches_no_driver(fake):
    backend = FakeGpuBackend("cuda:0", library_path=fake.path)
    backend.shutdown()
    assert fake.calls("cuInit") == 0


def test_invalid_device_ordinal_fails_bind(fake, make_setup):
    with pytest.raises(CudaError, match="cuDeviceGet failed: CUDA_ERROR_INVALID_DEVICE"):
        make_setup(device="cuda:5")


def test_copy_thread_makes_the_context_current_once(fake, make_setup):
    setup = make_setup()
    before = fake.calls("cuCtxSetCurrent")
    for job_id in range(3):
        setup.backend.submit(TransferJob(job_id, Direction.LOAD, [job_id], [job_id]))
    assert all(r.ok for r in setup.backend.flush())
    assert fake.calls("cuCtxSetCurrent") == before + 1
    assert np.array_equal(setup.kv[:, 2].numpy(), setup.host_view[:, 2].numpy())


def test_a_thread_that_never_used_the_gpu_can_submit(fake, make_setup):
    """The driver wants a current context in every calling thread: the backend sets it
    when it records a job's fence, whichever thread submits (found on an H100, where a
    job submitted from a fresh thread failed with CUDA_ERROR_INVALID_CONTEXT)."""
    setup = make_setup()
    results = []

    def submit_and_flush():
        setup.backend.submit(TransferJob(0, Direction.STORE, [3, 4], [7, 8]))
        results.extend(setup.backend.flush())

    thread = threading.Thread(target=submit_and_flush)
    thread.start()
    thread.join()
    assert [r.ok for r in results] == [True], results
    setup.assert_stored([3, 4], [7, 8])
