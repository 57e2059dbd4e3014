"""Registration, start-up errors and metrics of HALOffloadConnector."""

import pytest

from support.engine_harness import Engine  # noqa: F401 (sets the in-process vLLM environment)


def test_plugin_registers_the_name_once_and_is_idempotent():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvoffload_hal.connector import HALOffloadConnector
    from kvoffload_hal.plugin import CONNECTOR_NAME, register

    register()
    register()  # vLLM calls plugins in every process, possibly more than once
    assert KVConnectorFactory._registry[CONNECTOR_NAME]() is HALOffloadConnector


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("kvoffload_hal") == "kvoffload_hal.plugin:register"


def test_prefix_caching_is_required(tiny_model_dir):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from kvoffload_hal.connector import HALOffloadConnector
    from kvoffload_hal.demo.inprocess import offload_transfer_config

    config = EngineArgs(model=tiny_model_dir, enable_prefix_caching=False, enforce_eager=True,
                        kv_transfer_config=offload_transfer_config(),
                        ).create_engine_config()
    with pytest.raises(ValueError, match="needs prefix caching"):
        HALOffloadConnector(config, KVConnectorRole.SCHEDULER, object())


def test_stats_aggregate_reduce_and_prometheus_names():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvoffload_hal.connector import HALOffloadConnector
    from kvoffload_hal.metrics import COUNTERS, OffloadPromMetrics

    a = HALOffloadConnector.build_kv_connector_stats({"blocks_loaded": 2, "bytes_loaded": 4e9,
                                                      "load_seconds": 2.0})
    b = HALOffloadConnector.build_kv_connector_stats({"blocks_loaded": 3, "cpu_hit_tokens": 96})
    merged = a.aggregate(b).reduce()
    assert merged["blocks_loaded"] == 5 and merged["cpu_hit_tokens"] == 96
    assert merged["load_GBps"] == 2.0

    registry = CollectorRegistry()

    def bind(cls):
        return lambda **kw: cls(registry=registry, **{k: v for k, v in kw.items()
                                                      if k != "multiprocess_mode"})

    prom = OffloadPromMetrics(type("Cfg", (), {"kv_transfer_config": None})(),
                              {Counter: bind(Counter), Gauge: bind(Gauge),
                               Histogram: bind(Histogram)},
                              ["engine"], {0: ["0"]})
    prom.observe(merged, engine_idx=0)
    assert registry.get_sample_value("vllm:kvoffload_hal_blocks_loaded_total",
                                     {"engine": "0"}) == 5
    for key in COUNTERS:
        assert registry.get_sample_value(f"vllm:kvoffload_hal_{key}_total",
                                         {"engine": "0"}) is not None or merged.get(key, 0) == 0


def test_sleep_mode_is_offered_except_with_a_tier_shared_across_instances(tmp_path, caplog):
    """vLLM (>= 0.33) asks the class, through its factory, before it allows sleep mode."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvoffload_hal.demo.inprocess import offload_transfer_config

    plain = offload_transfer_config()
    connector = KVConnectorFactory.get_connector_class(plain)
    assert connector.supports_sleep_mode(plain) is True
    disk = offload_transfer_config(disk_path=str(tmp_path), disk_bytes_to_use=1 << 20)
    assert connector.supports_sleep_mode(disk) is True
    shared = offload_transfer_config(mooncake_master="127.0.0.1:50051")
    assert connector.supports_sleep_mode(shared) is False
    assert "refuses sleep mode with the Mooncake" in caplog.text


def test_cpu_tier_hits_are_reported_as_host_hits(make_engine):
    engine = make_engine()
    host = engine.offload.caps.vllm.hit_source()  # what this vLLM counts our hits as
    if host is None:
        pytest.skip("this vLLM does not count prefix-cache hits by source")
    request = engine.add("r", list(range(1, 50)))
    sources = engine.connector.get_external_cache_hit_sources(request, 32)
    assert sources == {host: 32}  # not "external_unspecified"
