"""The worker counts a backend leaving its batched copy call (``copy_path_fallbacks``)."""

from __future__ import annotations

import torch

from kvoffload_hal.backends.cpu import CpuCopyBackend
from kvoffload_hal.hal import register_backend
from kvoffload_hal.metadata import JobReport, OffloadMetadata, StoreSpec


class SwitchingCpuBackend(CpuCopyBackend):
    """Reports a batched path until its first copy, then a per-copy loop, as the CUDA and
    NPU backends do when the runtime answers "not supported" (the copies stay real)."""

    name = "switching-cpu"
    fallback_copy_paths = frozenset({"per-copy loop"})

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.switched = False

    @property
    def copy_path(self) -> str:
        return "per-copy loop" if self.switched else "batched call"

    def _launch(self, direction, batch, fence):
        self.switched = True
        return super()._launch(direction, batch, fence)


register_backend(SwitchingCpuBackend.name, f"{__name__}:SwitchingCpuBackend",
                 synchronous_compute=True)


def test_a_copy_path_switch_is_counted_once_in_the_stats(make_engine):
    engine = make_engine(backend="switching-cpu")
    worker = engine.worker.worker
    kv = engine.kv_storage.view(torch.uint8).view(engine.kv_storage.shape[0], -1)
    host = worker.host.chunks[0].view(worker.num_cpu_blocks, -1)
    assert worker.backend.copy_path == "batched call"
    assert not worker.backend.copy_path_is_fallback
    for job_id, (gpu, cpu) in enumerate([(3, 7), (5, 1), (6, 2)]):
        kv[gpu].fill_(0x40 + job_id)
        worker.bind_connector_metadata(OffloadMetadata(store=StoreSpec(job_id, [gpu], [cpu])))
        worker.get_finished(set())
        worker.clear_connector_metadata()
        worker.handle_preemptions(OffloadMetadata(need_flush=True))  # collect it now
        assert worker.build_connector_worker_meta().stores == {job_id: JobReport()}
        assert torch.equal(host[cpu], kv[gpu])
        step = worker.get_stats()
        assert step is not None
        assert step.reduce()["copy_path_fallbacks"] == (1 if job_id == 0 else 0)
    assert worker.totals.reduce()["copy_path_fallbacks"] == 1
    assert worker.backend.copy_path_is_fallback
