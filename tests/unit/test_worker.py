"""OffloadWorker on its public methods: each job launched once, reports, bytes copied."""

import gc
import weakref

import torch

from kvoffload_hal.metadata import JobReport, LoadSpec, OffloadMetadata, StoreSpec


def _worker(make_engine, **kwargs):
    engine = make_engine(**kwargs)
    worker = engine.worker.worker
    kv = engine.kv_storage.view(torch.uint8).view(engine.kv_storage.shape[0], -1)
    host = worker.host.chunks[0].view(worker.num_cpu_blocks, -1)  # one region: block-major
    return worker, kv, host


def test_a_store_is_launched_once_copied_and_reported_once(make_engine):
    worker, kv, host = _worker(make_engine)
    kv[3].copy_(torch.arange(kv.shape[1], dtype=torch.uint8))
    kv[5].fill_(0xA5)
    worker.bind_connector_metadata(OffloadMetadata(store=StoreSpec(0, [3, 5], [7, 1])))
    for _ in range(3):  # a step may collect more than once
        worker.get_finished(set())
    worker.clear_connector_metadata()
    assert worker.build_connector_worker_meta().stores == {0: JobReport()}
    assert worker.build_connector_worker_meta() is None  # handed over once
    assert torch.equal(host[7], kv[3]) and torch.equal(host[1], kv[5])
    assert worker.totals.data["bytes_stored"] == 2 * kv.shape[1]


def test_a_synchronous_load_lands_before_the_forward_pass(make_engine):
    worker, kv, host = _worker(make_engine)
    host[2].fill_(0x3C)
    load = LoadSpec(4, ("r",), cpu_blocks=[2], gpu_blocks=[9], sync=True)
    worker.bind_connector_metadata(OffloadMetadata(load=load))
    worker.start_load_kv()
    assert torch.equal(kv[9], host[2])  # before get_finished: the forward pass reads it next
    assert worker.get_finished(set()) == (set(), set(), set())  # the request is running
    assert worker.build_connector_worker_meta().loads == {4: JobReport()}
    assert worker.get_block_ids_with_load_errors() == set()


def test_a_failed_asynchronous_load_reports_its_blocks(make_engine):
    worker, _, _ = _worker(make_engine, backend="failing-loads",
                           extra_config={"load_mode": "async"})
    load = LoadSpec(0, ("r",), cpu_blocks=[0, 1], gpu_blocks=[4, 6])
    worker.bind_connector_metadata(OffloadMetadata(load=load))
    worker.start_load_kv()  # asynchronous: nothing to do before the forward pass
    _, finished, failed = worker.get_finished(set())
    # Leaves its wait state; with one KV cache group vLLM is told which blocks to recompute.
    assert finished == {"r"} and failed == set()
    assert worker.get_block_ids_with_load_errors() == {4, 6}
    assert worker.totals.data["failed_jobs"] == 1


def test_shutdown_keeps_the_host_buffer_while_a_copy_still_runs(make_engine, monkeypatch):
    from kvoffload_hal.worker import shutdown as worker_module
    from support.backend_doubles import GatedCpuBackend
    from support.polling import wait_until

    monkeypatch.setattr(worker_module, "SHUTDOWN_TIMEOUT_S", 0.2)
    GatedCpuBackend.gate.clear()
    worker, kv, host = _worker(make_engine, backend="gated-cpu")
    backend = worker.backend
    kv[3].fill_(0x5A)
    worker.bind_connector_metadata(OffloadMetadata(store=StoreSpec(0, [3], [7])))
    worker.get_finished(set())  # launched: the copy thread waits at the gate
    buffer = weakref.ref(worker.host.chunks[0])
    del host
    worker.shutdown()  # gives up waiting after 0.2 s
    gc.collect()
    assert buffer() is not None, "host buffer freed under a running copy"
    GatedCpuBackend.gate.set()  # the copy goes on, into memory that is still ours
    wait_until(lambda: not backend._thread.is_alive())
    assert torch.equal(buffer().view(worker.num_cpu_blocks, -1)[7], kv[3])
