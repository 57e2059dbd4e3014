"""The copy kernel's path through the backend, against the fake driver.

The fake loads only an image that defines ``kvoffload_copy_blocks``, takes the
launch's parameters as the driver does (pointers to each argument), refuses a
descriptor table outside registered host memory, and reads the table when the
kernel runs, not when it is launched: a table handed to another job too early
shows up as wrong bytes. Every test checks bytes.
"""

from __future__ import annotations

import logging

import pytest
from cuda_fake import CUDA_ERROR_ILLEGAL_ADDRESS

from kvoffload_hal import logger as package_logger
from kvoffload_hal.backends.cuda import _kernel
from kvoffload_hal.backends.cuda._kernel import (
    KERNEL_DIRECTIONS_ENV_VAR,
    KERNEL_MAX_BYTES,
    KERNEL_MAX_BYTES_ENV_VAR,
    MAX_GRID_BLOCKS,
    THREADS_PER_BLOCK,
)
from kvoffload_hal.hal.backend import Direction, TransferJob
from support.polling import wait_until

CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222
KERNEL = {"kernel_max_bytes": KERNEL_MAX_BYTES, "kernel_directions": "all"}


def _job(job_id, direction, src, dst):
    return TransferJob(job_id, direction, src, dst)


def test_small_blocks_go_by_one_kernel_launch_byte_for_byte(fake, make_setup):
    setup = make_setup(**KERNEL)
    src, dst = [3, 17, 4, 30, 9], [40, 2, 11, 7, 33]
    setup.backend.submit(_job(0, Direction.STORE, src, dst))
    assert all(r.ok for r in setup.backend.flush())
    setup.assert_stored(src, dst)
    setup.kv.zero_()
    setup.backend.submit(_job(1, Direction.LOAD, dst, [1, 5, 6, 20, 31]))
    assert all(r.ok for r in setup.backend.flush())
    setup.assert_loaded(dst, [1, 5, 6, 20, 31])

    store, load = fake.launches()
    assert fake.batches() == []  # no DMA at all
    for launch, direction in ((store, Direction.STORE), (load, Direction.LOAD)):
        assert launch.result == 0 and launch.stream == setup.backend._streams[direction]
        assert launch.count == 10  # 5 blocks, K and V: no ids are adjacent, so no runs
        assert (list(launch.grid), list(launch.block)) == ([10, 1, 1], [THREADS_PER_BLOCK, 1, 1])
    assert setup.backend.copy_kernel is not None


def test_by_default_loads_go_by_the_kernel_and_stores_by_dma(fake, make_setup, monkeypatch):
    """Stores run beside the model: the kernel would take its GPU cores (docs/cuda.md)."""
    monkeypatch.delenv(KERNEL_DIRECTIONS_ENV_VAR, raising=False)
    setup = make_setup(kernel_directions=None)  # the environment's, else the default
    setup.backend.submit(_job(0, Direction.STORE, [3, 9], [5, 1]))
    setup.backend.submit(_job(0, Direction.LOAD, [5, 1], [20, 21]))
    assert all(r.ok for r in setup.backend.flush())
    setup.assert_stored([3, 9], [5, 1])
    setup.assert_loaded([5, 1], [20, 21])
    (batch,) = fake.batches()
    (launch,) = fake.launches()
    assert batch.stream == setup.backend._streams[Direction.STORE]
    assert launch.stream == setup.backend._streams[Direction.LOAD]
    assert setup.backend.copy_kernel.startswith("copy kernel for loads of descriptors")


def test_grid_is_capped_however_many_descriptors(fake, make_setup):
    setup = make_setup(**KERNEL)
    src = list(range(0, 32, 2))  # every other block: 16 ids, 32 descriptors
    setup.backend.submit(_job(0, Direction.STORE, src, src))
    assert all(r.ok for r in setup.backend.flush())
    setup.assert_stored(src, src)
    (launch,) = fake.launches()
    assert launch.count == 32 and launch.grid[0] == min(32, MAX_GRID_BLOCKS)


def test_blocks_above_the_limit_go_by_dma(fake, make_setup):
    setup = make_setup(kernel_max_bytes=64, kernel_directions="all")  # blocks of 96 bytes
    setup.backend.submit(_job(0, Direction.STORE, [1, 8], [2, 9]))
    assert all(r.ok for r in setup.backend.flush())
    setup.assert_stored([1, 8], [2, 9])
    assert fake.launches() == [] and len(fake.batches()) == 1


def test_queued_kernels_read_their_own_tables(fake, make_setup):
    """Two stores queued before either runs: each kernel must still find its own
    descriptors when it runs, so a table is not reused before its job completed."""
    setup = make_setup(**KERNEL)
    backend = setup.backend
    fake.lib.fake_set_defer(1)  # kernels run only when something waits on them
    backend.submit(_job(0, Direction.STORE, [1, 3], [10, 12]))
    backend.submit(_job(1, Direction.STORE, [5, 7], [20, 22]))
    wait_until(lambda: len(fake.launches()) == 2, what="both kernels launched")
    assert all(r.ok for r in backend.flush())
    setup.assert_stored([1, 3, 5, 7], [10, 12, 20, 22])
    first, second = fake.launches()
    assert first.table != second.table


def test_tables_are_reused_once_their_jobs_completed(fake, make_setup):
    setup = make_setup(**KERNEL)
    registered_before = len(fake.registrations())
    for job_id in range(6):
        setup.backend.submit(_job(job_id, Direction.STORE, [job_id], [job_id + 8]))
        assert all(r.ok for r in setup.backend.flush())
    setup.assert_stored(range(6), range(8, 14))
    assert len({launch.table for launch in fake.launches()}) == 1
    assert len(fake.registrations()) == registered_before + 1  # one table, registered once


def test_failed_launch_fails_the_job_and_the_next_job_runs(fake, make_setup):
    setup = make_setup(**KERNEL)
    fake.lib.fake_fail_launch(CUDA_ERROR_ILLEGAL_ADDRESS, 0)
    setup.backend.submit(_job(0, Direction.STORE, [2], [4]))
    (failed,) = setup.backend.flush()
    assert not failed.ok and "cuLaunchKernel" in str(failed.error)
    assert (setup.host_view[:, 4] == 0).all()  # nothing was written
    fake.lib.fake_fail_launch(0, 0)
    setup.backend.submit(_job(1, Direction.STORE, [2], [4]))
    assert all(r.ok for r in setup.backend.flush())
    setup.assert_stored([2], [4])


@pytest.fixture
def warnings(caplog, monkeypatch):
    """Warnings logged from now on, ``log_once``'s memory of earlier tests cleared."""
    monkeypatch.setattr(package_logger, "_logged_messages", set())
    caplog.set_level(logging.WARNING)
    return lambda: [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_kernel_that_cannot_load_leaves_every_job_to_dma(fake, make_setup, warnings):
    fake.lib.fake_fail_module_load(CUDA_ERROR_UNSUPPORTED_PTX_VERSION)
    setup = make_setup(**KERNEL)
    setup.backend.submit(_job(0, Direction.STORE, [6], [1]))
    assert all(r.ok for r in setup.backend.flush())
    setup.assert_stored([6], [1])
    assert fake.launches() == [] and len(fake.batches()) == 1
    assert setup.backend.copy_kernel is None
    assert any("copy kernel unavailable" in m and "CUDA_ERROR_UNSUPPORTED_PTX_VERSION" in m
               for m in warnings())


def test_a_gpu_that_cannot_address_host_memory_gets_no_kernel(fake, make_setup, warnings):
    """Checked before any launch: a kernel fault would end the model's CUDA context."""
    fake.lib.fake_set_host_pointer_usable(0)
    setup = make_setup(**KERNEL)
    setup.backend.submit(_job(0, Direction.LOAD, [6], [1]))
    assert all(r.ok for r in setup.backend.flush())
    setup.assert_loaded([6], [1])
    assert fake.launches() == [] and fake.calls("cuModuleLoadData") == 0
    assert any("CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM is not 1" in m for m in warnings())


def test_shutdown_unloads_the_module_and_unregisters_every_table(fake, make_setup):
    setup = make_setup(**KERNEL)
    setup.backend.submit(_job(0, Direction.STORE, [2, 9], [4, 5]))
    assert all(r.ok for r in setup.backend.flush())
    assert fake.lib.fake_live_modules() == 1
    setup.close()
    assert fake.lib.fake_live_modules() == 0
    assert not any(r.registered for r in fake.registrations())
    assert fake.lib.fake_ctx_refcount(0) == 0  # the context was released after them


def test_a_kernel_turned_off_loads_no_module(fake, make_setup):
    setup = make_setup(kernel_max_bytes=KERNEL_MAX_BYTES, kernel_directions="off")
    setup.backend.submit(_job(0, Direction.LOAD, [2], [4]))
    assert all(r.ok for r in setup.backend.flush())
    assert fake.calls("cuModuleLoadData") == 0 and setup.backend.copy_kernel is None


@pytest.mark.parametrize("raw", ["0", "-1", "half", "1.5"])
def test_bad_kernel_max_bytes_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(KERNEL_MAX_BYTES_ENV_VAR, raw)
    with pytest.raises(ValueError, match=f"{KERNEL_MAX_BYTES_ENV_VAR}.*integer >= 1"):
        _kernel.kernel_max_bytes_setting(None)
    with pytest.raises(ValueError, match="kernel_max_bytes must be >= 1, got 0"):
        _kernel.kernel_max_bytes_setting(0)


def test_kernel_max_bytes_from_the_environment(monkeypatch):
    monkeypatch.setenv(KERNEL_MAX_BYTES_ENV_VAR, "4096")
    assert _kernel.kernel_max_bytes_setting(None) == 4096
    assert _kernel.kernel_max_bytes_setting(128) == 128  # the argument wins
    monkeypatch.delenv(KERNEL_MAX_BYTES_ENV_VAR)
    assert _kernel.kernel_max_bytes_setting(None) == KERNEL_MAX_BYTES


def test_kernel_directions_setting(monkeypatch):
    monkeypatch.delenv(KERNEL_DIRECTIONS_ENV_VAR, raising=False)
    assert _kernel.kernel_directions_setting(None) == {Direction.LOAD}
    monkeypatch.setenv(KERNEL_DIRECTIONS_ENV_VAR, "all")
    assert _kernel.kernel_directions_setting(None) == set(Direction)
    assert _kernel.kernel_directions_setting("off") == set()  # the argument wins
    monkeypatch.setenv(KERNEL_DIRECTIONS_ENV_VAR, "stores")
    with pytest.raises(ValueError, match=f"{KERNEL_DIRECTIONS_ENV_VAR}='stores': expected one "
                                         "of loads, all, off"):
        _kernel.kernel_directions_setting(None)
