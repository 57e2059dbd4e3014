"""Copies through the whole backend (bind/submit/poll/flush) against the fake driver.

Every test checks bytes, not just calls: the fake's copies are real memmoves
between the CPU tensors standing in for device memory and the registered host
tier.
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_fake import CUDA_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_NOT_SUPPORTED, SIZE_MAX
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload_hal import logger as package_logger
from kvoffload_hal.backends.cuda import _copy
from kvoffload_hal.backends.cuda import backend as cuda_backend
from kvoffload_hal.backends.cuda._driver import (
    CU_MEM_LOCATION_TYPE_DEVICE,
    CU_MEM_LOCATION_TYPE_HOST,
    CU_MEMCPY_SRC_ACCESS_ORDER_ANY,
    CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
)
from kvoffload_hal.hal.backend import Direction, TransferJob
from kvoffload_hal.hal.regions import merge_runs
from support.polling import collect_results, wait_until

NUM_DEVICE_BLOCKS, NUM_HOST_BLOCKS = 32, 48


def store(job_id, src, dst, tag=None):
    return TransferJob(job_id, Direction.STORE, src, dst, tag)


def load(job_id, src, dst, tag=None):
    return TransferJob(job_id, Direction.LOAD, src, dst, tag)


def expected_descriptors(src, dst, num_regions=2):
    return num_regions * len(merge_runs(src, dst)[0])


@st.composite
def block_pairs(draw, num_src, num_dst):
    """Distinct (src, dst) block pairs, often with consecutive runs on both sides."""
    n = draw(st.integers(1, min(num_src, num_dst)))
    if draw(st.booleans()):  # a few runs: consecutive ids, as an engine allocates them
        src_start = draw(st.integers(0, num_src - n))
        dst_start = draw(st.integers(0, num_dst - n))
        src, dst = list(range(src_start, src_start + n)), list(range(dst_start, dst_start + n))
        cut = draw(st.integers(0, n))
        dst = dst[cut:] + dst[:cut]  # rotate: splits the run in two
    else:
        src = draw(st.lists(st.integers(0, num_src - 1), min_size=n, max_size=n, unique=True))
        dst = draw(st.lists(st.integers(0, num_dst - 1), min_size=n, max_size=n, unique=True))
    return src, dst


@pytest.mark.parametrize("variant", ["cuda12_8", "cuda13", "no_batch"])
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_round_trip_is_byte_exact(fake, make_setup, variant, data):
    # Draw everything first: hypothesis may abandon an example inside a draw.
    src, dst = data.draw(block_pairs(NUM_DEVICE_BLOCKS, NUM_HOST_BLOCKS), label="store")
    load_src, load_dst = data.draw(block_pairs(len(dst), NUM_DEVICE_BLOCKS), label="load")
    fake.lib.fake_reset()
    setup = make_setup(max_descriptors=5)
    kv_before = setup.kv.clone()
    setup.backend.submit(store(0, src, dst, tag="s"))
    (result,) = setup.backend.flush()
    assert result.ok and result.tag == "s" and result.num_blocks == len(src)
    assert result.num_bytes == len(src) * 2 * setup.kv.shape[2]
    for s, d in zip(src, dst):
        assert np.array_equal(setup.host_view[:, d].numpy(), kv_before[:, s].numpy())

    # Load some stored blocks back into other device blocks.
    host_ids = [dst[i] for i in load_src]
    setup.kv[:, load_dst] = 0
    setup.backend.submit(load(0, host_ids, load_dst))
    (result,) = setup.backend.flush()
    assert result.ok
    for h, d in zip(host_ids, load_dst):
        origin = src[dst.index(h)]
        assert np.array_equal(setup.kv[:, d].numpy(), kv_before[:, origin].numpy())
    untouched = sorted(set(range(NUM_DEVICE_BLOCKS)) - set(load_dst))
    assert np.array_equal(setup.kv[:, untouched].numpy(), kv_before[:, untouched].numpy())

    total = expected_descriptors(src, dst) + expected_descriptors(host_ids, load_dst)
    if variant == "no_batch":
        assert fake.calls("cuMemcpyAsync") == total
    else:
        assert sum(b.count for b in fake.batches()) == total
    setup.close()
    assert fake.lib.fake_live_events() == 0  # every fence and completion event destroyed


def test_runs_merge_into_one_descriptor_each(fake, make_setup):
    setup = make_setup()
    src, dst = [0, 1, 2, 5, 6, 9], [10, 11, 12, 3, 4, 7]  # runs: 0-2, 5-6, 9
    setup.backend.submit(store(0, src, dst))
    assert setup.backend.flush()[0].ok
    (batch,) = fake.batches()
    assert batch.count == 3 * 2  # three runs in each of the two (K, V) regions
    assert batch.num_args == 9 and fake.calls("cuMemcpyAsync") == 0


@pytest.mark.parametrize(("direction", "order", "src_type", "dst_type"), [
    (Direction.STORE, CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, CU_MEM_LOCATION_TYPE_DEVICE,
     CU_MEM_LOCATION_TYPE_HOST),
    (Direction.LOAD, CU_MEMCPY_SRC_ACCESS_ORDER_ANY, CU_MEM_LOCATION_TYPE_HOST,
     CU_MEM_LOCATION_TYPE_DEVICE),
])
def test_one_attribute_per_batch_with_the_direction_s_access_order(
        fake, make_setup, direction, order, src_type, dst_type):
    setup = make_setup(device="cuda:1")
    setup.backend.submit(TransferJob(0, direction, [3, 4, 8], [1, 2, 9]))
    assert setup.backend.flush()[0].ok
    (batch,) = fake.batches()
    assert (batch.num_attrs, batch.attrs_idx0) == (1, 0)
    assert batch.src_access_order == order
    assert (batch.src_loc_type, batch.dst_loc_type) == (src_type, dst_type)
    device_side = batch.src_loc_id if direction is Direction.STORE else batch.dst_loc_id
    assert device_side == 1 and batch.flags == 0
    assert batch.stream == setup.backend._streams[direction]


def test_batches_are_chunked_at_max_descriptors(fake, make_setup):
    setup = make_setup(max_descriptors=4)
    src = [0, 2, 4, 6, 8]  # five runs x two regions = ten descriptors
    dst = [1, 3, 5, 7, 9]
    setup.backend.submit(store(0, src, dst))
    assert setup.backend.flush()[0].ok
    assert [b.count for b in fake.batches()] == [4, 4, 2]
    for s, d in zip(src, dst):
        assert np.array_equal(setup.host_view[:, d].numpy(), setup.kv[:, s].numpy())


def test_max_descriptors_from_env_var(fake, monkeypatch):
    monkeypatch.setenv(cuda_backend.MAX_DESCRIPTORS_ENV_VAR, "3")
    assert cuda_backend.CudaCopyBackend("cuda:0").max_descriptors == 3
    monkeypatch.delenv(cuda_backend.MAX_DESCRIPTORS_ENV_VAR)
    assert cuda_backend.CudaCopyBackend("cuda:0").max_descriptors == cuda_backend.MAX_DESCRIPTORS
    with pytest.raises(ValueError, match="must be positive"):
        cuda_backend.CudaCopyBackend("cuda:0", max_descriptors=0)
    with pytest.raises(ValueError, match="must be positive"):
        _copy.BatchCopier(None, None, 0, 0)


@pytest.mark.parametrize(("raw", "expected"), [
    ("many", "an integer >= 1"), ("2.5", "an integer >= 1"), ("0", ">= 1"), ("-4", ">= 1"),
])
def test_bad_max_descriptors_env_var_is_named(fake, monkeypatch, raw, expected):
    monkeypatch.setenv(cuda_backend.MAX_DESCRIPTORS_ENV_VAR, raw)
    with pytest.raises(ValueError) as info:
        cuda_backend.CudaCopyBackend("cuda:0")
    message = str(info.value)
    assert message.startswith(f"KVOFFLOAD_HAL_CUDA_MAX_DESCRIPTORS={raw!r}")
    assert expected in message and "\n" not in message


@pytest.mark.parametrize("variant", ["no_batch"])
def test_loop_fallback_without_batch_entry_point_is_logged_once(
        fake, make_setup, caplog, monkeypatch):
    monkeypatch.setattr(package_logger, "_logged_messages", set())
    with caplog.at_level("INFO", logger=cuda_backend.__name__):
        first, _ = make_setup(), make_setup()
    assert first.backend.copy_path == _copy.LOOP_PATH
    messages = [r.getMessage() for r in caplog.records if "copies:" in r.getMessage()]
    assert len(messages) == 1 and "cuMemcpyAsync loop" in messages[0]
    first.backend.submit(store(0, [1, 2, 7], [0, 1, 5]))
    assert first.backend.flush()[0].ok
    assert fake.calls("cuMemcpyAsync") == 4 and fake.batches() == []
    assert np.array_equal(first.host_view[:, 5].numpy(), first.kv[:, 7].numpy())


def test_not_supported_switches_to_the_loop_for_good(fake, make_setup, caplog):
    setup = make_setup()
    assert setup.backend.copy_path == "cuMemcpyBatchAsync (CUDA 12.8 ABI)"
    fake.lib.fake_fail_batch(CUDA_ERROR_NOT_SUPPORTED, SIZE_MAX, 0)
    with caplog.at_level("WARNING", logger=_copy.__name__):
        setup.backend.submit(store(0, [0, 1, 4], [2, 3, 8]))
        setup.backend.submit(store(1, [5], [9]))
        results = setup.backend.flush()
    assert [r.ok for r in results] == [True, True]
    assert len(fake.batches()) == 1  # tried once, then never again
    assert fake.calls("cuMemcpyAsync") == 4 + 2
    assert setup.backend.copy_path == _copy.LOOP_PATH
    assert sum("CUDA_ERROR_NOT_SUPPORTED" in r.getMessage() for r in caplog.records) == 1
    for s, d in [(0, 2), (1, 3), (4, 8), (5, 9)]:
        assert np.array_equal(setup.host_view[:, d].numpy(), setup.kv[:, s].numpy())


@pytest.mark.parametrize(("variant", "detail"), [
    ("cuda12_8", "at descriptor 5 of 10"),  # failIdx 1 in the second chunk of 4
    ("cuda13", ""),  # the 13.0 ABI reports no index
])
def test_copy_error_fails_the_job(fake, make_setup, detail):
    setup = make_setup(max_descriptors=4)
    fake.lib.fake_fail_batch(CUDA_ERROR_ILLEGAL_ADDRESS, 1, 1)  # second call fails
    setup.backend.submit(store(0, [0, 2, 4, 6, 8], [1, 3, 5, 7, 9], tag="t"))
    (result,) = setup.backend.flush()
    assert not result.ok and result.num_bytes == 0 and result.tag == "t"
    assert "CUDA_ERROR_ILLEGAL_ADDRESS (700)" in result.error
    assert result.error.endswith(f"(700){' ' + detail if detail else ''}")
    assert fake.calls("cuStreamSynchronize") == 1  # the first chunk drained before reporting
    fake.lib.fake_fail_batch(0, SIZE_MAX, 0)
    setup.backend.submit(store(1, [0], [0]))  # the backend keeps working
    assert setup.backend.flush()[0].ok


@pytest.mark.parametrize("variant", ["no_batch"])
def test_loop_copy_error_fails_the_job(fake, make_setup):
    setup = make_setup()
    fake.lib.fake_fail_memcpy(CUDA_ERROR_ILLEGAL_ADDRESS, 2)
    setup.backend.submit(store(0, [0, 2], [1, 3]))
    (result,) = setup.backend.flush()
    assert not result.ok
    assert result.error.endswith("cuMemcpyAsync failed: CUDA_ERROR_ILLEGAL_ADDRESS (700) "
                                 "at descriptor 2 of 4")


@pytest.mark.parametrize("use_flush", [False, True])
def test_event_error_fails_the_job(fake, make_setup, use_flush):
    setup = make_setup()
    fake.lib.fake_set_defer(1)
    setup.backend.submit(load(0, [0, 1], [4, 5]))
    wait_until(lambda: fake.calls("cuEventRecord") == 2, what="the fence and completion events")
    fake.lib.fake_fail_query(CUDA_ERROR_ILLEGAL_ADDRESS)
    results = setup.backend.flush() if use_flush else setup.backend.poll()
    assert len(results) == 1 and not results[0].ok
    fn = "cuEventSynchronize" if use_flush else "cuEventQuery"
    assert f"{fn} failed: CUDA_ERROR_ILLEGAL_ADDRESS" in results[0].error
    fake.lib.fake_fail_query(0)
    assert setup.backend.num_pending == 0 and fake.lib.fake_live_events() == 0


def test_poll_reports_not_ready_jobs_later(fake, make_setup):
    setup = make_setup()
    fake.lib.fake_set_defer(1)
    setup.backend.submit(store(0, [3, 4], [0, 1], tag="late"))
    wait_until(lambda: fake.calls("cuEventRecord") == 2, what="the fence and completion events")
    assert setup.backend.poll() == [] and setup.backend.num_pending == 1
    assert not setup.host_view[:, :2].any()  # nothing copied yet
    fake.lib.fake_run_all()
    (result,) = setup.backend.poll()
    assert result.ok and result.tag == "late" and setup.backend.num_pending == 0
    assert np.array_equal(setup.host_view[:, 0:2].numpy(), setup.kv[:, 3:5].numpy())
    assert setup.backend.poll() == []


def test_empty_job_completes_without_a_copy(fake, make_setup):
    setup = make_setup()
    setup.backend.submit(load(0, [], []))
    (result,) = setup.backend.flush()
    assert result.ok and result.num_bytes == 0
    setup.backend.submit(store(0, [], []))
    (result,) = collect_results(setup.backend.poll, 1)  # polled, not flushed, this time
    assert result.ok and result.num_bytes == 0
    assert fake.batches() == [] and fake.calls("cuEventRecord") == 0
    assert fake.lib.fake_live_events() == 0  # no fence recorded for a job never launched
