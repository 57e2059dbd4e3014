"""The connector's worker on the NPU backend puts a large CPU tier in several
``aclrtMallocHost`` calls, and its stores and loads stay byte for byte.

The fake runtime refuses any ``aclrtMallocHost`` above a limit (207001), as one
call above about 200-250 GB does on Atlas A2; the chunk size is set under it.
The worker, its metadata and the backend are the real ones; the device KV is
laid out as vllm-ascend lays it out (separate K and V tensors per layer).
"""

from __future__ import annotations

import time

from ascend_kv import ascend_kv

from kvoffload_hal.backends.npu._host import HOST_CHUNK_BYTES_ENV
from kvoffload_hal.metadata import LoadSpec, OffloadMetadata, StoreSpec

KiB = 1 << 10


def _worker(make_engine, npu_env, monkeypatch, chunk_bytes):
    from kvoffload_hal.worker.core import OffloadWorker

    engine = make_engine(cpu_blocks=64)  # vLLM's configs: 64 CPU blocks
    monkeypatch.setenv("KVOFFLOAD_HAL_BACKEND", "npu")
    monkeypatch.setenv(HOST_CHUNK_BYTES_ENV, str(chunk_bytes))
    npu_env.use("full").set_malloc_host_limit(chunk_bytes)
    kv = ascend_kv(num_layers=3, num_blocks=engine.kv_cache_config.num_blocks)
    for t in kv.tensors:
        npu_env.acl.declare_device_memory(t.data_ptr(), t.numel() * t.element_size(), 0)
    worker = OffloadWorker(engine.vllm_config, engine.kv_cache_config, engine.offload.config)
    caches = {f"layer.{i}": [kv.tensors[2 * i], kv.tensors[2 * i + 1]] for i in range(3)}
    return worker, kv, caches


def _run(worker, metadata, sync=False):
    worker.bind_connector_metadata(metadata)
    if sync:
        worker.start_load_kv()
    for _ in range(500):
        worker.get_finished(set())
        reports = worker.build_connector_worker_meta()
        if reports is not None and (reports.stores or reports.loads):
            worker.clear_connector_metadata()
            return reports
        time.sleep(0.01)  # the copy thread runs the job
    raise AssertionError("the job was never reported")


def test_the_worker_spreads_the_tier_over_chunks_and_copies_byte_for_byte(
        make_engine, npu_env, monkeypatch):
    # 6 regions (3 layers x K, V) of 1 KiB per block x 64 blocks = 64 KiB each; the
    # runtime refuses calls above 160 KiB: two regions per chunk, three chunks.
    worker, kv, caches = _worker(make_engine, npu_env, monkeypatch, 160 * KiB)
    before = npu_env.acl.live_host_allocs()
    worker.register_kv_caches(caches)
    host = worker.host
    assert len(host.chunks) == 3 and host.chunk_of == (0, 0, 1, 1, 2, 2)
    assert npu_env.acl.max_malloc_host_size() <= 160 * KiB
    assert npu_env.acl.live_host_allocs() == before + 3
    device_blocks, host_blocks = [3, 7, 11], [0, 31, 63]  # chunk ends included
    originals = [[kv.block(i, b) for b in device_blocks] for i in range(6)]
    report = _run(worker, OffloadMetadata(store=StoreSpec(0, device_blocks, host_blocks)))
    assert not report.stores[0].failed
    views = host.region_views()
    for i in range(6):
        assert [views[i][h].numpy().tobytes() for h in host_blocks] == originals[i]
    back = [12, 13, 14]
    load = LoadSpec(1, ("r",), cpu_blocks=host_blocks, gpu_blocks=back, sync=True)
    report = _run(worker, OffloadMetadata(load=load), sync=True)
    assert not report.loads[1].failed
    for i in range(6):
        assert [kv.block(i, b) for b in back] == originals[i]
    worker.shutdown()
    assert npu_env.acl.live_host_allocs() == before  # every chunk freed
