"""An engine that goes idle finishes its last writes within ``shutdown_flush_timeout_s``.

The rules on :class:`ExitFlush` itself, then on the harness's engine (vLLM's real
scheduler, both connector roles, a disk tier): the request held for its last writes
keeps vLLM's own idle test (``has_requests``) true until its blocks are on disk,
and vLLM frees it when the workers report it.
"""

import os
import threading

import pytest

from kvoffload_hal.exit_flush import ExitFlush
from support.clock import FakeClock

BS = 16
PAGE = BS * 128  # one harness block: 16 tokens x 128 bytes of K and V
DOC_BLOCKS = 5


def test_the_last_finished_request_is_held_until_its_writes_are_done():
    flush = ExitFlush(2.0, holds_requests=True, clock=FakeClock())
    assert flush.on_finished("r1", delayed=False, pending=True) is True  # freed later
    assert flush.take_released(pending=True) == ()
    assert flush.take_released(pending=False) == ("r1",)
    assert flush.held is None and flush.take_released(pending=False) == ()
    assert flush.on_finished("r2", delayed=False, pending=False) is False  # nothing to wait


def test_a_held_request_goes_at_the_bound_and_one_is_held_at_a_time():
    clock = FakeClock()
    flush = ExitFlush(2.0, holds_requests=True, clock=clock)
    flush.on_finished("r1", delayed=False, pending=True)
    flush.on_finished("r2", delayed=False, pending=True)
    assert flush.take_released(pending=True) == ("r1",) and flush.held == "r2"
    clock.now += 1.9
    assert flush.take_released(pending=True) == ()
    clock.now += 0.2  # a stuck disk: the engine stops stepping for it
    assert flush.take_released(pending=True) == ("r2",)


def test_a_request_freed_later_for_its_load_is_never_held_twice():
    flush = ExitFlush(2.0, holds_requests=True, clock=FakeClock())
    assert flush.on_finished("r1", delayed=True, pending=True) is True
    assert flush.held is None and flush.take_released(pending=False) == ()  # released once


def test_without_holding_nothing_is_held_and_a_zero_bound_waits_for_nothing():
    for flush in (ExitFlush(2.0, holds_requests=False), ExitFlush(0.0, holds_requests=True)):
        assert flush.on_finished("r1", delayed=False, pending=True) is False
        assert flush.take_released(pending=False) == ()


def test_pending_writes_keep_an_idle_engine_stepping_only_within_the_bound():
    clock = FakeClock()
    flush = ExitFlush(2.0, holds_requests=False, clock=clock)
    assert flush.steps_for_writes(pending=True) and not flush.steps_for_writes(pending=False)
    clock.now += 2.1  # since start-up
    assert not flush.steps_for_writes(pending=True)
    flush.on_finished("r1", delayed=False, pending=True)
    assert flush.steps_for_writes(pending=True)


def _disk_engine(make_engine, tmp_path, holds: bool, clock=None):
    engine = make_engine(num_gpu_blocks=20, cpu_blocks=8, extra_config={
        "disk_path": str(tmp_path), "disk_bytes_to_use": 100 * PAGE})
    # As in an engine core process on vLLM < 0.32 (the harness runs in the main one).
    engine.connector.exit_flush = ExitFlush(2.0, holds_requests=holds,
                                            **({"clock": clock} if clock else {}))
    return engine


def _files(root):
    return [f for _, _, files in os.walk(root) for f in files if f.endswith(".kvb")]


def _free_device_blocks(engine):
    return engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def test_the_request_held_for_its_last_writes_has_them_on_disk_when_the_engine_idles(
        make_engine, tmp_path):
    engine = _disk_engine(make_engine, tmp_path / "held", holds=True)
    free = _free_device_blocks(engine)
    engine.add("r", list(range(1, DOC_BLOCKS * BS + 2)), max_tokens=1)
    engine.run_until_done()  # the engine core's own idle test: vLLM's has_requests()
    assert engine.offload.totals.data["blocks_to_disk"] == DOC_BLOCKS
    assert len(_files(tmp_path / "held")) == DOC_BLOCKS
    assert not engine.scheduler.requests  # freed once the workers released it
    assert _free_device_blocks(engine) == free and engine.offload.num_pinned_cpu_blocks() == 0
    # Without holding, only vLLM >= 0.32 steps an idle engine for the connector.
    other = _disk_engine(make_engine, tmp_path / "not-held", holds=False)
    other.add("r", list(range(1, DOC_BLOCKS * BS + 2)), max_tokens=1)
    other.run_until_done()
    assert other.offload.has_pending_transfers() == other.offload.caps.vllm.holds_last_request()


def test_a_request_held_on_a_stuck_disk_is_released_at_the_bound(
        make_engine, tmp_path, monkeypatch):
    clock = FakeClock()
    engine = _disk_engine(make_engine, tmp_path, holds=True, clock=clock)
    tier = engine.worker.worker.tiers.nearest
    gate = threading.Event()
    write_file = tier._write_file
    monkeypatch.setattr(tier, "_write_file", lambda path, data: gate.wait()
                        and write_file(path, data))  # a hung mount
    engine.add("r", list(range(1, DOC_BLOCKS * BS + 2)), max_tokens=1)
    for _ in range(20):
        engine.step()
    assert engine.connector.exit_flush.held == "r" and engine.scheduler.has_requests()
    clock.now += 2.5
    engine.run_until_done(max_steps=5)
    assert not engine.scheduler.requests
    assert engine.offload.has_pending_transfers()  # the spill is still stuck
    gate.set()
    engine.drain()


@pytest.mark.parametrize("flush_s, kept", [(5.0, 1), (0.2, 0)])
def test_at_shutdown_a_write_gets_the_flush_bound_then_is_dropped_whole(
        tmp_path, flush_s, kept):
    import torch

    from kvoffload_hal.tiers.disk.worker import DiskTier

    tier = DiskTier(str(tmp_path), 0, [torch.ones(2, 64, dtype=torch.uint8)], keep=True)
    entered, gate = threading.Event(), threading.Event()
    write_file = tier._write_file

    def slow_write(path, data):
        write_file(path, data)  # the temporary is whole, not renamed yet
        entered.set()
        gate.wait()

    tier._write_file = slow_write
    tier.submit_store(0, [("ab01", 0)])
    assert entered.wait(10)
    threading.Timer(0.5, gate.set).start()  # the write ends 0.5 s into the shutdown
    assert tier.shutdown(timeout_s=10, flush_s=flush_s) is True
    names = [f for _, _, files in os.walk(tier.root) for f in files if f.endswith((
        ".kvb", ".tmp"))]
    assert names == (["ab01.kvb"] if kept else [])  # whole, or nothing, never a temporary
