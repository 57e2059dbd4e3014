"""Two things a backend does for vLLM 0.33: follow a KV cache that moved (sleep
mode) and fence a step's copies at the end of its forward pass (finish_forward)."""

from __future__ import annotations

import pytest
import torch

from kvoffload_hal.backends.cpu import CpuCopyBackend
from kvoffload_hal.hal.backend import Direction, TransferJob
from support.backend_rig import BackendRig

BLOCK = 64
STORE, LOAD = Direction.STORE, Direction.LOAD


class FencingBackend(CpuCopyBackend):
    """Counts the fences each kind of call records; ``fence_error``: the
    forward-end fence cannot be set."""

    def __init__(self, fence_error: Exception | None = None):
        super().__init__()
        self.fence_error = fence_error
        self.job_fences = 0
        self.stream_fences = 0

    def _prepare(self, job):
        self.job_fences += 1
        return None

    def _fence_copy_streams(self):
        if self.fence_error is not None:
            raise self.fence_error
        self.stream_fences += 1


def _rig(backend, num_blocks=8):
    kv = torch.randint(0, 256, (num_blocks, BLOCK), dtype=torch.uint8)
    return BackendRig(backend, [kv], num_blocks, num_blocks)


def test_rebind_moves_later_copies_to_the_new_addresses():
    rig = _rig(CpuCopyBackend())
    try:
        moved = torch.zeros_like(rig.kv)
        rig.backend.rebind(rig.backend.describe_kv_tensor(moved, 8))
        rig.host_view[0, 3].fill_(0x5C)
        rig.backend.submit(TransferJob(0, LOAD, [3], [6]))
        assert rig.backend.flush()[0].ok
        assert (moved[6] == 0x5C).all()  # the new tensor got the block
        assert not (rig.kv[6] == 0x5C).all()  # the old one did not
    finally:
        rig.close()


def test_rebind_refuses_pending_jobs_and_another_layout():
    rig = _rig(CpuCopyBackend())
    try:
        with pytest.raises(ValueError, match="layout changed"):
            rig.backend.rebind(rig.backend.describe_kv_tensor(torch.zeros(8, 2 * BLOCK,
                                                                          dtype=torch.uint8), 8))
        rig.backend.submit(TransferJob(0, STORE, [1], [1]))
        with pytest.raises(RuntimeError, match="1 job.* pending: flush"):
            rig.backend.rebind(rig.device_regions)
        rig.backend.flush()
        rig.backend.rebind(rig.device_regions)  # nothing pending: accepted
    finally:
        rig.close()


def test_a_forward_end_fence_stands_for_the_step_jobs_own():
    backend = FencingBackend()
    rig = _rig(backend)
    try:
        backend.submit(TransferJob(0, LOAD, [0], [0]))  # before the forward pass: its own
        backend.forward_done()
        backend.submit(TransferJob(0, STORE, [1], [1]))
        backend.submit(TransferJob(1, LOAD, [1], [2]))
        assert (backend.job_fences, backend.stream_fences) == (1, 1)
        backend.step_done()
        backend.submit(TransferJob(2, LOAD, [2], [3]))  # the next step's first job
        assert backend.job_fences == 2
        assert all(r.ok for r in backend.flush())
    finally:
        rig.close()


def test_a_forward_end_fence_that_fails_leaves_each_job_its_own(caplog):
    backend = FencingBackend(fence_error=RuntimeError("event pool exhausted"))
    rig = _rig(backend)
    try:
        backend.forward_done()  # must not raise into vLLM's step
        backend.submit(TransferJob(0, STORE, [1], [1]))
        assert backend.job_fences == 1
        assert "event pool exhausted" in caplog.text
        assert backend.flush()[0].ok
    finally:
        rig.close()


def test_a_backend_without_stream_fences_keeps_fencing_each_job():
    backend = CpuCopyBackend()  # no copy streams: jobs fence one by one (here: none)
    rig = _rig(backend)
    try:
        backend.forward_done()
        assert backend._fenced_at_forward_end is False
        backend.submit(TransferJob(0, STORE, [2], [2]))
        assert backend.flush()[0].ok
        rig.assert_stored([2], [2])
    finally:
        rig.close()
