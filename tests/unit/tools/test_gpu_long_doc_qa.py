"""The GPU long-document QA's engines: what each configuration asks vLLM for."""

import inspect

import pytest

from kvoffload_hal.capabilities import records_copies
from kvoffload_hal.eviction.registry import eviction_names, unregister_eviction

gpu_qa = pytest.importorskip("gpu_long_doc_qa")
# long_doc_qa registers its benchmark-only eviction variant at import, at collection:
# every other test in this process would see it among the policies.
if "adaptive-no-ends" in eviction_names():
    unregister_eviction("adaptive-no-ends")

SHAPE = gpu_qa.SHAPES["llama-3.2-1b"]
LENGTH, MAX_DOCS = 2048, 32


def _spec(config):
    return gpu_qa.engine_spec(config, SHAPE, "/model", LENGTH, MAX_DOCS)


def test_block_bytes_of_the_llama_shape():
    # 16 layers x 8 KV heads x head_dim 64 x 32 tokens x (K, V) x bf16 = 1 MiB
    assert gpu_qa.block_bytes(SHAPE) == 1 << 20
    assert gpu_qa.cpu_bytes(SHAPE, LENGTH) == 30 * 64 << 20


def test_both_connectors_get_the_same_cpu_bytes_and_device_cache():
    prefix, hal, upstream = (_spec(c) for c in (gpu_qa.PREFIX, gpu_qa.HAL, gpu_qa.UPSTREAM))
    per_doc = gpu_qa.blocks_per_doc(LENGTH)
    assert prefix.num_gpu_blocks == hal.num_gpu_blocks == upstream.num_gpu_blocks \
        == 8 * per_doc + 1
    assert (prefix.offload, hal.offload, upstream.offload) == (False, True, False)
    assert prefix.connector is None and hal.connector is None
    hal_cfg = gpu_qa.hal_config_dict(hal)
    assert hal_cfg["kv_connector"] == "HALOffloadConnector"
    assert hal_cfg["extra"]["cpu_bytes_to_use"] == gpu_qa.cpu_bytes(SHAPE, LENGTH)
    extra = upstream.connector["kv_connector_extra_config"]
    assert upstream.connector["kv_connector"] == "OffloadingConnector"
    assert extra == {"spec_name": "CPUOffloadingSpec", "eviction_policy": "lru",
                     "cpu_bytes_to_use": hal_cfg["extra"]["cpu_bytes_to_use"]}
    kwargs = upstream.llm_kwargs()
    assert kwargs["kv_transfer_config"].kv_connector == "OffloadingConnector"
    assert kwargs["kv_transfer_config"].kv_connector_extra_config == extra
    assert kwargs["enable_prefix_caching"] and kwargs["block_size"] == 32


def test_the_same_batch_limit_holds_every_request_eight_at_a_time():
    limit = _spec(gpu_qa.SAME_BATCH)
    assert limit.num_gpu_blocks == 2 * MAX_DOCS * gpu_qa.blocks_per_doc(LENGTH) + 1
    assert limit.max_num_seqs == 8 and not limit.offload and limit.connector is None
    with pytest.raises(ValueError, match="config='lmcache': expected one of prefix-cache"):
        gpu_qa.engine_spec("lmcache", SHAPE, "/model", LENGTH, MAX_DOCS)


def test_the_upstream_keys_are_the_ones_this_vllm_reads():
    from vllm.v1.kv_offload import factory
    from vllm.v1.kv_offload.cpu import spec as spec_mod

    source = inspect.getsource(spec_mod) + inspect.getsource(factory)
    for key in ("cpu_bytes_to_use", "eviction_policy", "spec_name"):
        assert f'"{key}"' in source, key


def test_copy_totals_and_the_table():
    hal = gpu_qa.copy_totals_hal({"bytes_loaded": 4e9, "load_seconds": 0.5,
                                  "bytes_stored": 2e9, "store_seconds": 1.0})
    up = gpu_qa.copy_totals_upstream({"CPU_to_GPU_total_bytes": 1e9,
                                      "CPU_to_GPU_total_time": 0.25})
    assert up == dict(load_bytes=1e9, load_s=0.25, store_bytes=0, store_s=0.0)
    row = dict(num_docs=8, wall_s=2.0, ttft_mean=0.1, ttft_p50=0.1, ttft_p99=0.2,
               cached_tokens=100, prompt_tokens=200)
    digest = gpu_qa.tokens_digest([[1, 2], [3]])
    assert digest != gpu_qa.tokens_digest([[1, 2], [4]])
    rows = [dict(row, config=gpu_qa.HAL, copies=hal, tokens=digest),
            dict(row, config=gpu_qa.PREFIX, wall_s=4.0, copies=up, tokens=digest),
            dict(row, config=gpu_qa.UPSTREAM, copies=up, tokens="0" * 12)]
    lines = gpu_qa.format_table(rows).splitlines()
    assert lines[2].startswith("| 8 | prefix-cache | 4.000 | 1.00 |")
    assert lines[3].startswith("| 8 | hal-offload | 2.000 | 0.50 |")
    assert lines[3].endswith("| 3.73 | 8.0 | 1.86 | 2.0 | same |")
    assert lines[4].endswith(f"| DIFFER {'0' * 12} |")


def test_each_count_has_documents_of_its_own():
    a, b = gpu_qa.documents(4, 64, 1000, 0), gpu_qa.documents(4, 64, 1000, 1)
    assert a == gpu_qa.documents(4, 64, 1000, 0) and not set(map(tuple, a)) & set(map(tuple, b))
    assert all(2 <= t < 1000 for d in a for t in d)


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [dict(num_docs=n, config=c, wall_s=1.0 + k, ttft_mean=0.1)
            for n in (8, 16) for k, c in enumerate(gpu_qa.CONFIGS)]
    gpu_qa.plot(rows, tmp_path / "p.png", "title")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_upstream_copy_records_are_counted_as_another_process_would_send_them():
    """In one process vLLM 0.23's per-copy records are dataclasses, which its own
    ``reduce()`` and Prometheus logger refuse; the meter hands them on as dicts."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import metrics

    if not records_copies(metrics.OffloadingConnectorStats):
        pytest.skip("this vLLM's OffloadingConnectorStats keeps no per-copy records")
    stats = metrics.OffloadingConnectorStats()
    stats.record_transfer(100, 0.5, ("CPU", "GPU"))
    stats.record_transfer(50, 0.25, ("CPU", "GPU"))
    stats.record_transfer(7, 1.0, ("GPU", "CPU"))
    with pytest.raises(AssertionError):
        stats.reduce()
    stats.data = gpu_qa.as_sent(stats.data)
    sums = {}
    gpu_qa.add_upstream_ops(sums, stats.data)
    assert sums == stats.reduce()
    assert gpu_qa.copy_totals_upstream(sums) == dict(load_bytes=150, load_s=0.75,
                                                     store_bytes=7, store_s=1.0)
