"""Job bookkeeping of ThreadedCopyBackend, exercised through real CPU-backend subclasses."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from kvoffload_hal.backends.cpu import CpuCopyBackend
from kvoffload_hal.hal import threaded
from kvoffload_hal.hal.backend import Direction, TransferJob
from support.backend_rig import BackendRig
from support.polling import collect_results

BLOCK = 256
STORE, LOAD = Direction.STORE, Direction.LOAD


class RecordingBackend(CpuCopyBackend):
    """Records every launch; optionally sleeps or waits on a gate before copying."""

    def __init__(self, sleep_s: tuple[float, float] = (0.0, 0.0),
                 gate: threading.Event | None = None):
        super().__init__()
        self.sleep_s, self.gate = sleep_s, gate
        self.launches: list[tuple[Direction, int]] = []
        self.stopped = False

    def _launch(self, direction, batch, fence):
        self.launches.append((direction, batch.num_bytes))
        if self.gate is not None:
            self.gate.wait()
        if self.sleep_s[1]:
            time.sleep(random.uniform(*self.sleep_s))
        return super()._launch(direction, batch, fence)

    def _stop(self):
        self.stopped = True
        super()._stop()


def make_rig(backend: CpuCopyBackend, num_blocks: int = 16,
             num_host_blocks: int = 16) -> BackendRig:
    """``backend`` bound to one device tensor of ``num_blocks`` distinct blocks of BLOCK bytes."""
    kv = torch.arange(num_blocks * BLOCK, dtype=torch.int32).view(num_blocks, -1).to(torch.uint8)
    kv += torch.arange(num_blocks, dtype=torch.uint8).view(-1, 1)  # blocks differ
    return BackendRig(backend, [kv], num_blocks, num_host_blocks)


@pytest.fixture
def rig():
    r = make_rig(RecordingBackend())
    yield r
    r.close()


def test_results_carry_job_fields_and_arrive_once(rig):
    rig.backend.submit(TransferJob(0, STORE, [3, 4, 5, 9], [0, 1, 2, 3], tag={"req": "a"}))
    rig.backend.submit(TransferJob(0, LOAD, [0], [12], tag="b"))
    results = collect_results(rig.backend.poll, 2)
    assert [(r.job_id, r.direction, r.ok, r.num_blocks, r.num_bytes, r.tag) for r in results] == [
        (0, STORE, True, 4, 4 * BLOCK, {"req": "a"}),
        (0, LOAD, True, 1, BLOCK, "b"),
    ]
    assert all(r.error is None and r.seconds >= 0 for r in results)
    assert rig.backend.poll() == [] and rig.backend.num_pending == 0
    rig.assert_stored([9], [3])
    assert torch.equal(rig.kv[12], rig.initial_device_block(0, 3))


def test_tags_survive_many_polls_and_steps(rig):
    seen = {}
    for step in range(50):
        rig.backend.submit(TransferJob(step, STORE, [step % 16], [step % 16], tag=("step", step)))
        for r in rig.backend.poll():
            seen.setdefault(r.job_id, []).append(r.tag)
    for r in rig.backend.flush():
        seen.setdefault(r.job_id, []).append(r.tag)
    assert seen == {i: [("step", i)] for i in range(50)}


def test_resubmission_launches_once(rig):
    job = TransferJob(5, STORE, [1], [1])
    rig.backend.submit(job)
    rig.backend.submit(job)
    rig.backend.submit(TransferJob(4, STORE, [2], [2]))  # older id: ignored too
    rig.backend.submit(TransferJob(5, LOAD, [1], [2]))  # ids are per direction
    results = rig.backend.flush()
    assert sorted((r.direction.value, r.job_id) for r in results) == [("load", 5), ("store", 5)]
    assert [d for d, _ in rig.backend.launches] == [STORE, LOAD]
    assert rig.backend.poll() == []


@pytest.mark.parametrize(
    ("src", "dst", "match"),
    [([16], [0], "out of range"), ([0, 1], [3, 3], "appears twice")],
)
def test_invalid_job_is_a_failed_result_not_a_success(rig, src, dst, match):
    rig.backend.submit(TransferJob(0, STORE, src, dst, tag="t"))
    (result,) = collect_results(rig.backend.poll, 1)
    assert (result.ok, result.num_bytes, result.tag) == (False, 0, "t")
    assert "ValueError" in result.error and match in result.error
    assert rig.backend.launches == [] and torch.count_nonzero(rig.host) == 0
    # The backend keeps working after a failed job.
    rig.backend.submit(TransferJob(1, STORE, [0], [0]))
    assert [r.ok for r in rig.backend.flush()] == [True]


def test_failing_launch_is_reported_as_failed():
    class Failing(CpuCopyBackend):
        def _launch(self, direction, batch, fence):
            raise OSError("DMA engine on fire")

    r = make_rig(Failing())
    r.backend.submit(TransferJob(0, LOAD, [1], [1]))
    (result,) = r.backend.flush()
    assert not result.ok and result.error == "OSError: DMA engine on fire" and result.num_bytes == 0
    r.backend.shutdown()


class FailingPrepare(RecordingBackend):
    """``_prepare`` raises for the ids in ``fail_ids``, as when no compute fence can be recorded."""

    def __init__(self, fail_ids, gate: threading.Event | None = None):
        super().__init__(gate=gate)
        self.fail_ids = set(fail_ids)

    def _prepare(self, job):
        if job.job_id in self.fail_ids:
            raise RuntimeError(f"no compute stream for job {job.job_id}")
        return super()._prepare(job)


@pytest.mark.parametrize("report", ["poll", "flush"])
def test_failing_prepare_is_a_failed_job_not_an_engine_error(report):
    r = make_rig(FailingPrepare(fail_ids={0}))
    r.backend.submit(TransferJob(0, STORE, [1], [1], tag="t"))  # must not raise
    assert r.backend.num_pending == 1
    if report == "poll":
        (result,) = collect_results(r.backend.poll, 1)
    else:
        (result,) = r.backend.flush()
    assert (result.job_id, result.direction, result.ok, result.num_bytes, result.tag) == (
        0, STORE, False, 0, "t")
    assert result.error == "RuntimeError: no compute stream for job 0"
    assert r.backend.launches == [] and torch.count_nonzero(r.host) == 0  # never launched
    assert r.backend.num_pending == 0 and r.backend.poll() == []
    r.backend.submit(TransferJob(0, STORE, [1], [1]))  # its id was taken: ignored
    assert r.backend.num_pending == 0
    r.backend.submit(TransferJob(1, STORE, [2], [2]))  # a later job still works
    assert [(x.job_id, x.ok) for x in r.backend.flush()] == [(1, True)]
    r.assert_stored([2], [2])
    r.close()


def test_failing_prepare_is_reported_in_submission_order():
    gate = threading.Event()
    r = make_rig(FailingPrepare(fail_ids={1}, gate=gate))
    for i in range(3):
        r.backend.submit(TransferJob(i, LOAD, [i], [i]))
    assert r.backend.poll() == []  # job 0 is held at the gate; job 1 waits behind it
    gate.set()
    assert [(x.job_id, x.ok) for x in r.backend.flush()] == [(0, True), (1, False), (2, True)]
    assert [d for d, _ in r.backend.launches] == [LOAD, LOAD]
    r.close()


def test_submit_before_bind_and_double_bind_raise():
    b = CpuCopyBackend()
    with pytest.raises(RuntimeError, match="bind"):
        b.submit(TransferJob(0, STORE, [0], [0]))
    r = make_rig(b)
    with pytest.raises(RuntimeError, match="already bound"):
        b.bind([], [])
    r.backend.shutdown()
    with pytest.raises(ValueError, match="regions"):
        CpuCopyBackend().bind(r.device_regions, [])


def test_flush_waits_for_queued_and_launched_jobs():
    gate = threading.Event()
    r = make_rig(RecordingBackend(gate=gate))
    for i in range(3):
        r.backend.submit(TransferJob(i, STORE, [i], [i]))
    time.sleep(0.05)
    assert len(r.backend.launches) <= 1  # job 0 is held at the gate; 1 and 2 are queued
    threading.Timer(0.2, gate.set).start()
    start = time.monotonic()
    results = r.backend.flush()
    assert time.monotonic() - start >= 0.15
    assert [(x.job_id, x.ok) for x in results] == [(0, True), (1, True), (2, True)]
    r.assert_stored(range(3), range(3))
    assert r.backend.poll() == [] and r.backend.flush() == [] and r.backend.num_pending == 0
    r.backend.shutdown()


def test_flush_with_nothing_pending_does_not_wake_the_copy_thread(rig, monkeypatch):
    # A worker flushes on every preemption, mostly with nothing pending; a barrier
    # round trip to the copy thread is then a context switch for nothing on a host
    # whose cores all run compute threads.
    barriers = []

    class CountedBarrier(threaded._Barrier):
        def __init__(self, reached):
            barriers.append(self)
            super().__init__(reached)

    monkeypatch.setattr(threaded, "_Barrier", CountedBarrier)
    rig.backend.submit(TransferJob(0, STORE, [3], [0]))
    assert [x.job_id for x in rig.backend.flush()] == [0]
    assert len(barriers) == 1  # a job was pending: the flush waited for the copy thread
    assert rig.backend.flush() == [] and rig.backend.num_pending == 0
    assert len(barriers) == 1
    rig.assert_stored([3], [0])


def test_shutdown_with_a_stuck_copy_returns_within_its_timeout():
    gate = threading.Event()
    r = make_rig(RecordingBackend(gate=gate))
    for i in range(3):
        r.backend.submit(TransferJob(i, STORE, [i], [i]))
    # The copy is stuck until the gate opens: returning before that is giving up on it
    # (a wall-clock bound of a few times the timeout failed once on a loaded host). A
    # shutdown that waited for the copy returns once a watchdog opens the gate, and fails.
    watchdog = threading.Timer(30, gate.set)
    watchdog.start()
    assert r.backend.shutdown(timeout_s=0.3) is False
    assert not gate.is_set() and r.backend._thread.is_alive()
    assert r.backend.shutdown(timeout_s=0.3) is False  # idempotent, gave up already
    with pytest.raises(RuntimeError, match="shut down"):
        r.backend.submit(TransferJob(3, STORE, [3], [3]))
    # A flush after a shutdown that gave up must not wait for a barrier nobody reaches.
    results = r.backend.flush()
    assert not gate.is_set()
    watchdog.cancel()
    gate.set()
    r.backend._thread.join(5)
    assert not r.backend._thread.is_alive()
    # Nothing queued at shutdown is launched afterwards: the memory may be gone.
    assert len(r.backend.launches) == 1
    results += collect_results(r.backend.poll, 3 - len(results), timeout_s=2)
    assert sorted(x.job_id for x in results if not x.ok) == [1, 2]
    assert not r.backend.stopped  # resources left alone while the thread was busy


def test_shutdown_waits_for_in_flight_jobs_and_stops():
    r = make_rig(RecordingBackend(sleep_s=(0.02, 0.02)))
    for i in range(4):
        r.backend.submit(TransferJob(i, STORE, [i], [i]))
    r.backend.shutdown(timeout_s=5)
    assert len(r.backend.launches) == 4 and r.backend.stopped
    r.assert_stored(range(4), range(4))


def test_stress_one_engine_thread_many_jobs_with_random_launch_delays():
    nb, num_jobs, load_dsts = 32, 400, range(24, 32)
    r = make_rig(RecordingBackend(sleep_s=(0.0, 0.0005)), num_blocks=nb,
                 num_host_blocks=num_jobs + 8)
    # Host blocks num_jobs.. hold patterns the loads bring back to device blocks 24..31.
    for h in range(8):
        r.host_block(0, num_jobs + h).fill_(200 + h)
    rng = random.Random(0)
    seen: dict[tuple[str, int], list] = {}
    expected_load_src = {}
    store_id = load_id = 0

    def record(results):
        for x in results:
            seen.setdefault((x.direction.value, x.job_id), []).append(x)

    for step in range(num_jobs):
        # Stores read device blocks 0..23 only; loads write 24..31 only.
        r.backend.submit(TransferJob(store_id, STORE, [step % 24], [step], tag=("s", step)))
        store_id += 1
        if rng.random() < 0.5:
            src, dst = num_jobs + rng.randrange(8), rng.choice(load_dsts)
            r.backend.submit(TransferJob(load_id, LOAD, [src], [dst], tag=("l", load_id)))
            expected_load_src[dst] = src
            load_id += 1
        if rng.random() < 0.3:
            record(r.backend.poll())
    record(r.backend.flush())
    assert r.backend.poll() == [] and r.backend.num_pending == 0
    assert len(seen) == store_id + load_id
    for (direction, job_id), results in seen.items():
        assert len(results) == 1
        (x,) = results
        assert x.ok and x.num_bytes == BLOCK and x.tag == (direction[0], job_id)
    r.assert_stored([step % 24 for step in range(num_jobs)], range(num_jobs))
    # The last load into a block wins.
    r.assert_loaded(list(expected_load_src.values()), list(expected_load_src))
    r.backend.shutdown()


def test_independent_backends_from_several_threads():
    errors = []

    def worker(seed: int) -> None:
        try:
            r = make_rig(RecordingBackend(sleep_s=(0.0, 0.0002)), num_blocks=16, num_host_blocks=64)
            got = []
            for i in range(64):
                r.backend.submit(TransferJob(i, STORE, [(i + seed) % 16], [i], tag=seed))
                got += r.backend.poll()
            got += r.backend.flush()
            assert sorted(x.job_id for x in got) == list(range(64))
            assert all(x.ok and x.tag == seed for x in got)
            r.assert_stored([(i + seed) % 16 for i in range(64)], range(64))
            r.backend.shutdown()
        except BaseException as e:  # noqa: BLE001 - re-raised on the test thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def test_the_lagging_double_reports_a_job_at_the_first_poll_of_a_later_step():
    """``lagging-cpu`` (tests' backend doubles) keeps copies in flight for exactly one
    step on any host: the engine tests that use it depend on it."""
    from support.backend_doubles import LaggingCpuBackend

    rig = make_rig(LaggingCpuBackend())
    try:
        backend = rig.backend
        backend.submit(TransferJob(0, STORE, [1, 2], [0, 1]))
        assert backend.poll() == [] and backend.num_pending == 1
        backend.step_done()
        backend.submit(TransferJob(0, LOAD, [0], [9]))
        assert [(r.direction, r.job_id, r.ok) for r in backend.poll()] == [(STORE, 0, True)]
        assert backend.num_pending == 1
        rig.assert_stored([1, 2], [0, 1])
        assert [(r.direction, r.job_id) for r in backend.flush()] == [(LOAD, 0)]
        assert backend.num_pending == 0 and backend.poll() == []
        assert torch.equal(rig.kv[9], rig.initial_device_block(0, 1))
    finally:
        rig.close()
