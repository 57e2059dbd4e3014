"""A disk tier that stops answering (a hung file system) costs a recompute, never a hang.

Every tier bounds its waits by its own (the disk tier's ``disk_timeout_s``, 10 s unless
set) and has a circuit breaker (scheduler/secondary/breaker.py). The scheduler runs on a
clock the test moves (support.clock.install_clock): each engine step is half a second of
it. The disk's reads or writes wait on an event the test sets at the end, as IO calls
blocked in the kernel would.
"""

import threading

from support.clock import FakeClock, install_clock
from support.polling import wait_for_tier_io
from support.serving_rig import serve

BS = 16
PAGE = BS * 128
STEP_S = 0.5  # of the fake clock, per engine step
WAIT_STEPS = int(10.0 / STEP_S)  # the disk tier's default wait, in steps


def _doc(seed, blocks):
    return [(seed * 7 + i) % 89 + 1 for i in range(blocks * BS + 1)]


def _disk_engine(make_engine, tmp_path, cpu_blocks, **disk):
    engine = make_engine(cpu_blocks=cpu_blocks, num_gpu_blocks=24,
                         max_num_batched_tokens=4 * BS,
                         extra_config={"disk_path": str(tmp_path / "kv"),
                                       "disk_bytes_to_use": 256 * PAGE, **disk})
    clock = FakeClock()
    assert install_clock(engine.offload, clock) > 0
    return engine, clock


def _on_disk_only(engine, doc):
    """Serve ``doc``, then two others that push it out of the device and the CPU tier."""
    serve(engine, ("first", doc))
    for seed in (2, 3):
        serve(engine, (f"other-{seed}", _doc(seed, 10)))


def _hang(tier, method):
    """The worker tier's ``method`` (its reads or its writes) waits for the returned event."""
    gate = threading.Event()
    call = getattr(tier, method)
    setattr(tier, method, lambda items: (gate.wait(60), call(items))[1])
    return gate


def _steps_until_finished(engine, clock, req_id, max_steps, step_s=STEP_S):
    for n in range(max_steps):
        if req_id in engine.finished:
            return n
        engine.step()
        clock.now += step_s
    return None


def test_a_read_the_disk_never_answers_is_recomputed_after_the_wait(make_engine, tmp_path):
    """Fails where a disk tier's reads have no wait: the request waits for ever."""
    for cpu_blocks in (16, 8):  # the hit promoted whole, then staged through the CPU tier
        engine, clock = _disk_engine(make_engine, tmp_path / str(cpu_blocks), cpu_blocks)
        doc = _doc(1, 10)
        _on_disk_only(engine, doc)
        gate = _hang(engine.worker.worker.tiers.nearest, "_load_batch")
        try:
            engine.add("again", doc)
            steps = _steps_until_finished(engine, clock, "again", 3 * WAIT_STEPS)
        finally:
            gate.set()
        assert steps is not None, "the request waited for the disk past its wait"
        assert steps > WAIT_STEPS  # it did wait for the read, up to the wait
        assert engine.outputs["again"] == engine.outputs["first"]
        totals = engine.offload.totals.data
        assert totals["disk_timeouts"] == 1 and totals["disk_breaker_opens"] == 1
        assert engine.cached_tokens["again"] < 10 * BS  # recomputed, not served


def test_writes_the_disk_never_answers_stop_keeping_an_idle_engine_busy(make_engine,
                                                                       tmp_path):
    """Fails where a disk tier has no breaker: the stuck writes stay pending work."""
    engine, clock = _disk_engine(make_engine, tmp_path, cpu_blocks=32, disk_timeout_s=3.0)
    tier = engine.worker.worker.tiers.nearest
    gate = _hang(tier, "_store_batch")
    try:
        stuck_since = None  # when the first write reached the worker (store copies
        engine.add("doc", _doc(1, 10))  # land on their own thread's time)
        for _ in range(200 + WAIT_STEPS):  # the request's steps, then idle ones
            if stuck_since is None and tier.num_pending:
                stuck_since = clock.now - STEP_S  # sent in the step before
            if ("doc" in engine.finished
                    and engine.offload.totals.data.get("disk_breaker_opens")):
                break  # the clock stops here: the breaker stays open
            engine.step()
            clock.now += STEP_S
        assert "doc" in engine.finished
        assert engine.offload.totals.data["disk_breaker_opens"] == 1
        # Opened by disk_timeout_s (3 s after the first write was sent), not 10 s.
        assert clock.now - stuck_since <= 3.0 + 2 * STEP_S
        assert not engine.offload.has_pending_transfers()  # stuck writes are no work
        # While the breaker is open (its first window: 1 s, the clock stopped), a new
        # request's blocks are not sent to the disk.
        engine.add("while-open", _doc(4, 3))
        assert _steps_until_finished(engine, clock, "while-open", 200, step_s=0) is not None
        totals = engine.offload.totals.data
        assert totals["disk_breaker_skips"] >= 1 and "blocks_to_disk" not in totals
    finally:
        gate.set()
    # The disk answers again: after the breaker's window the next request probes it, the
    # late writes are reported, and the breaker closes.
    wait_for_tier_io(tier)
    clock.now += 60.0
    serve(engine, ("after", _doc(5, 3)))
    totals = engine.offload.totals.data
    assert totals["disk_breaker_closes"] == 1 and totals["blocks_to_disk"] >= 10
    assert engine.outputs["doc"]
    engine.assert_idle()


def test_disk_timeout_s_is_a_number_of_seconds_and_needs_disk_path(tmp_path):
    import pytest

    from kvoffload_hal.config import OffloadConfig

    for bad in (0, -1, "5", True):
        with pytest.raises(ValueError, match=r"disk_timeout_s'\]=.*expected a number of "
                                             r"seconds > 0"):
            OffloadConfig.from_extra_config({"disk_path": str(tmp_path),
                                             "disk_bytes_to_use": 1 << 20,
                                             "disk_timeout_s": bad})
    with pytest.raises(ValueError, match=r"'disk_timeout_s'\] is set but 'disk_path' is not"):
        OffloadConfig.from_extra_config({"disk_timeout_s": 3.0})
