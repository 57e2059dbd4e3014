"""A tier written outside the package and shared by two engines (support.object_store_tier):
with no line of the package naming it, it gets existence queries, staged hits, prefetch,
the circuit breaker and counters of its own. vLLM's real scheduler in the engine harness;
every KV read is checked by the fake model."""

import time

import pytest

from kvoffload_hal.tiers import registry
from support.object_store_tier import ENTRY_POINT, STORES
from support.serving_rig import serve

BS = 16
DOC_BLOCKS = 20


@pytest.fixture
def object_store(monkeypatch):
    # Instances that share a store must name blocks alike: one block-hash seed for all
    # (vLLM 0.23 draws a random one per engine otherwise).
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    registry.register_tier("objstore", ENTRY_POINT)
    yield
    registry.unregister_tier("objstore")
    for store in STORES.values():
        store.thaw()
    STORES.clear()


def _serve(engine, *requests):
    return serve(engine, *requests)


def _engine(make_engine, cpu_blocks, **extra):
    return make_engine(cpu_blocks=cpu_blocks, num_gpu_blocks=2 * DOC_BLOCKS + 8,
                       max_num_batched_tokens=4 * BS,
                       extra_config={"object_store": "shared", **extra})


def _doc(seed):
    return [(seed * 11 + i * 3) % 89 + 1 for i in range(DOC_BLOCKS * BS + 1)]


def _count(engine, key):
    return engine.offload.totals.data.get(key, 0)


def test_a_hit_another_engine_wrote_comes_back_whole_through_a_small_cpu_tier(
        make_engine, object_store):
    writer = _engine(make_engine, cpu_blocks=64)
    _serve(writer, ("first", _doc(1)))
    assert _count(writer, "blocks_to_objstore") == DOC_BLOCKS
    reader = _engine(make_engine, cpu_blocks=6)  # a third of the document
    _serve(reader, ("again", _doc(1)))
    assert reader.outputs["again"] == writer.outputs["first"]
    assert reader.cached_tokens["again"] == DOC_BLOCKS * BS
    assert _count(reader, "staged_hits") == 1
    assert _count(reader, "blocks_from_objstore") >= DOC_BLOCKS - 6
    reader.assert_idle()


def test_a_waiting_request_is_prefetched_from_the_other_engines_writes(
        make_engine, object_store):
    writer = _engine(make_engine, cpu_blocks=64)
    doc = _doc(2)[:6 * BS + 1]
    _serve(writer, ("first", doc))
    reader = make_engine(cpu_blocks=32, num_gpu_blocks=48, max_num_seqs=1,
                         extra_config={"object_store": "shared"})
    reader.add("filler", [90] * (2 * BS + 1), max_tokens=1000)
    reader.step()
    reader.add("doc", doc)
    for _ in range(20):  # the query, then the promotion, while "doc" waits
        reader.step()
        time.sleep(0.005)
    assert reader.scheduler.requests["doc"].num_computed_tokens == 0  # still queued
    assert _count(reader, "blocks_prefetched") == 6
    reader.abort(["filler"])
    _serve(reader)
    assert reader.outputs["doc"] == writer.outputs["first"]
    assert reader.cached_tokens["doc"] == 6 * BS
    reader.assert_idle()


def test_a_frozen_store_opens_the_breaker_and_a_thawed_one_closes_it(
        make_engine, object_store):
    writer = _engine(make_engine, cpu_blocks=64)
    _serve(writer, ("first", _doc(3)))
    reader = _engine(make_engine, cpu_blocks=64, object_store_timeout_s=0.2)
    STORES["shared"].freeze()
    _serve(reader, ("frozen", _doc(3)))  # the query times out: recomputed
    assert reader.outputs["frozen"] == writer.outputs["first"]
    assert reader.cached_tokens["frozen"] == 0
    assert _count(reader, "objstore_timeouts") == 1
    assert _count(reader, "objstore_breaker_opens") == 1
    _serve(reader, ("skipped", _doc(4)))  # answered a miss at once while open
    assert _count(reader, "objstore_breaker_skips") >= 1
    STORES["shared"].thaw()
    time.sleep(1.2)  # past the breaker's first window: the next request probes
    reader.scheduler.reset_prefix_cache(reset_connector=True)
    _serve(reader, ("thawed", _doc(3)))
    assert _count(reader, "objstore_breaker_closes") == 1
    assert reader.outputs["thawed"] == writer.outputs["first"]
    assert reader.cached_tokens["thawed"] == DOC_BLOCKS * BS
    reader.assert_idle()


def _keys(request, n):
    from support.shared_tier import tier_keys

    return tier_keys(request, n)


def test_a_block_gone_between_the_query_and_the_read_ends_the_staged_hit_there(
        make_engine, object_store):
    writer = _engine(make_engine, cpu_blocks=64)
    first = writer.add("first", _doc(5))
    _serve(writer)
    STORES["shared"].vanish_after_probe = {_keys(first, DOC_BLOCKS)[11]}
    reader = _engine(make_engine, cpu_blocks=6)
    _serve(reader, ("again", _doc(5)))
    assert reader.outputs["again"] == writer.outputs["first"]
    assert reader.cached_tokens["again"] == 11 * BS  # up to the vanished block, no further
    assert _count(reader, "staged_hits") == 0
    assert _count(reader, "objstore_failed_blocks") >= 1
    reader.assert_idle()


def test_a_staged_read_that_does_not_land_in_time_ends_the_hit(make_engine, object_store):
    writer = _engine(make_engine, cpu_blocks=64)
    _serve(writer, ("first", _doc(6)))
    STORES["shared"].freeze_after_reads = 8  # the store hangs after the first batch
    # The first batch must land within the read wait, also on a loaded host; the
    # frozen one must not (it lands only once thawed).
    reader = _engine(make_engine, cpu_blocks=6, object_store_timeout_s=1.5)
    _serve(reader, ("again", _doc(6)))
    assert reader.outputs["again"] == writer.outputs["first"]
    assert 0 < reader.cached_tokens["again"] < DOC_BLOCKS * BS
    assert _count(reader, "objstore_breaker_opens") == 1  # the overdue read opened it
    STORES["shared"].thaw()  # (an open breaker does not keep an idle engine stepping)
    _serve(reader, ("later", _doc(7)))
    reader.assert_idle()  # the late read's CPU blocks were let go


def test_its_counters_are_exported_under_its_name(object_store):
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvoffload_hal.metrics import OffloadPromMetrics, OffloadStats

    registry_ = CollectorRegistry()

    def bind(cls):
        return lambda **kw: cls(registry=registry_, **{k: v for k, v in kw.items()
                                                       if k != "multiprocess_mode"})

    prom = OffloadPromMetrics(type("Cfg", (), {"kv_transfer_config": None})(),
                              {Counter: bind(Counter), Gauge: bind(Gauge),
                               Histogram: bind(Histogram)}, ["engine"], {0: ["0"]})
    stats = OffloadStats()
    stats.record_tier("objstore", spilled=3, timeouts=1)
    stats.record_breaker("objstore", opened=1)
    prom.observe(stats.reduce(), engine_idx=0)
    for name, value in (("blocks_to_objstore", 3), ("objstore_timeouts", 1),
                        ("objstore_breaker_opens", 1)):
        assert registry_.get_sample_value(f"vllm:kvoffload_hal_{name}_total",
                                          {"engine": "0"}) == value, name
    families = {m.name for m in registry_.collect()}
    assert "vllm:kvoffload_hal_blocks_from_objstore" in families  # declared before use
