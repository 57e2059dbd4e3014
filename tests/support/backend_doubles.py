"""CPU-backend subclasses that misbehave on purpose (real copies, real queues).

Selected through the registry like any plugin backend, so the connector under
test runs its normal code path.
"""

from __future__ import annotations

import threading
import time

from kvoffload_hal.backends.cpu import CpuCopyBackend
from kvoffload_hal.hal import CopyBatch, Direction, register_backend

launches: list[tuple[str, int]] = []  # (direction, descriptors) of every launch, in order


class SlowCpuBackend(CpuCopyBackend):
    """Each launch takes a while, and the worker does not wait for it (as on a
    device): jobs stay in flight across engine steps."""

    name = "slow-cpu"
    synchronous_compute = False
    delay_s = 0.004

    def _launch(self, direction, batch, fence):
        time.sleep(self.delay_s)
        return super()._launch(direction, batch, fence)


class BandwidthBoundCpuBackend(CpuCopyBackend):
    """A saturated copy link: each launch takes time in proportion to its bytes
    (:attr:`seconds_per_byte`), launches one after another on the copy thread,
    and the worker does not wait for them (as on a device)."""

    name = "bandwidth-bound"
    synchronous_compute = False
    seconds_per_byte = 1e-3 / 2048  # 1 ms per engine-harness block of 2 KiB

    def _launch(self, direction, batch, fence):
        time.sleep(float(batch.sizes.sum()) * self.seconds_per_byte)
        return super()._launch(direction, batch, fence)


class GatedCpuBackend(CpuCopyBackend):
    """Each copy waits for :attr:`gate` (a copy that outlives shutdown's wait)."""

    name = "gated-cpu"
    synchronous_compute = False
    gate = threading.Event()

    def _launch(self, direction, batch, fence):
        self.gate.wait()
        return super()._launch(direction, batch, fence)


class LaggingCpuBackend(CpuCopyBackend):
    """Jobs in flight for exactly one step, whatever the host's speed: a job is
    reported by the first poll of a later step than the one that submitted it (steps
    counted by ``step_done``), and never earlier. Where ``slow-cpu``'s sleep races the
    engine's steps, this gives the same asynchronous copies in the same order on every
    run."""

    name = "lagging-cpu"
    synchronous_compute = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._step = 0
        self._submitted_in: dict[tuple, int] = {}
        self._held: list = []

    def step_done(self) -> None:
        self._step += 1
        super().step_done()

    def submit(self, job):
        self._submitted_in[(job.direction, job.job_id)] = self._step
        return super().submit(job)

    def poll(self):
        due = []
        for result in self._take_held() + super().flush():
            key = (result.direction, result.job_id)
            if self._submitted_in[key] < self._step:
                due.append(result)
                del self._submitted_in[key]
            else:
                self._held.append(result)
        self._num_pending += len(self._held)
        return due

    def flush(self):
        results = self._take_held() + super().flush()
        for result in results:
            self._submitted_in.pop((result.direction, result.job_id), None)
        return results

    def _take_held(self) -> list:
        held, self._held = self._held, []
        self._num_pending -= len(held)
        return held

class CountingCpuBackend(CpuCopyBackend):
    name = "counting-cpu"

    def _launch(self, direction, batch, fence):
        launches.append((direction.value, len(batch)))
        return super()._launch(direction, batch, fence)


class FailingLoadsBackend(CpuCopyBackend):
    """Every load copies half of its descriptors, then fails (a torn load)."""

    name = "failing-loads"

    def _launch(self, direction, batch, fence):
        if direction is Direction.LOAD:
            half = len(batch) // 2
            super()._launch(direction, CopyBatch(batch.src_ptrs[:half], batch.dst_ptrs[:half],
                                                 batch.sizes[:half]), fence)
            raise RuntimeError("injected load failure")
        return super()._launch(direction, batch, fence)


class AsyncFailingLoadsBackend(FailingLoadsBackend):
    """Failing loads, reported per request as a device backend's are (async loads)."""

    name = "failing-loads-async"
    synchronous_compute = False


class FailingStoresBackend(CpuCopyBackend):
    name = "failing-stores"

    def _launch(self, direction, batch, fence):
        if direction is Direction.STORE:
            raise RuntimeError("injected store failure")
        return super()._launch(direction, batch, fence)


class SwitchedStoresBackend(CpuCopyBackend):
    """Every store (and rescue) fails while :attr:`failing` is set."""

    name = "switched-stores"
    failing = threading.Event()

    def _launch(self, direction, batch, fence):
        if direction is Direction.STORE and self.failing.is_set():
            raise RuntimeError("injected store failure")
        return super()._launch(direction, batch, fence)


class FencingCpuBackend(CpuCopyBackend):
    """Records, in order, each submission and the fence it waits for: its own
    (``job-fence``, taken at submission) or the forward pass's end (``forward-end``,
    set by ``forward_done`` and standing for every job until ``step_done``)."""

    name = "fencing-cpu"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[tuple] = []

    def submit(self, job):
        self.events.append(("submit", job.direction.value, job.job_id))
        return super().submit(job)

    def _prepare(self, job):
        self.events.append(("job-fence", job.direction.value, job.job_id))
        return None

    def _fence_copy_streams(self):
        self.events.append(("forward-end",))


for _cls in (SlowCpuBackend, LaggingCpuBackend, BandwidthBoundCpuBackend, GatedCpuBackend,
             CountingCpuBackend, FailingLoadsBackend, AsyncFailingLoadsBackend,
             FailingStoresBackend, SwitchedStoresBackend, FencingCpuBackend):
    register_backend(_cls.name, f"{__name__}:{_cls.__name__}",
                     synchronous_compute=_cls.synchronous_compute)
