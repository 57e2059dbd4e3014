"""Eviction policies are plug-ins: found by name through the registry's entry points.

``support.mru_eviction`` is a policy written outside the package; these tests
install it the way a third-party package declares it (an entry point in the
group ``kvoffload_hal.eviction``) and run it in an engine next to ``lru``.
"""

import pytest

from kvoffload_hal.config import OffloadConfig
from kvoffload_hal.eviction import registry
from support.entry_points import install_entry_points
from support.mru_eviction import ENTRY_POINT, MruEviction

BS = 16
DOC_TOKENS = 5 * BS  # five blocks


@pytest.fixture
def mru(tmp_path, monkeypatch):
    install_entry_points(tmp_path, monkeypatch, {registry.ENTRY_POINT_GROUP: {"mru": ENTRY_POINT}})


def test_an_entry_point_policy_is_a_valid_eviction_name(mru):
    assert registry.eviction_names()[:2] == ("lru", "adaptive")  # built-ins first
    assert "mru" in registry.eviction_names()
    assert OffloadConfig.from_extra_config({"eviction": "mru"}).eviction == "mru"


def test_a_policy_registered_at_run_time_is_valid_until_unregistered():
    registry.register_eviction("mru", ENTRY_POINT)
    try:
        assert OffloadConfig.from_extra_config({"eviction": "mru"}).eviction == "mru"
        with pytest.raises(ValueError, match="eviction policy name 'lru' is reserved"):
            registry.register_eviction("lru", ENTRY_POINT)
        with pytest.raises(ValueError, match="must look like 'package.module:PolicyClass'"):
            registry.register_eviction("bad", "no_colon")
    finally:
        registry.unregister_eviction("mru")
    assert "mru" not in registry.eviction_names()


def test_without_its_entry_point_the_name_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"\['eviction'\]='mru'.*lru, adaptive"):
        OffloadConfig.from_extra_config({"eviction": "mru"})


def test_a_broken_policy_fails_with_its_name(make_engine, tmp_path, monkeypatch):
    install_entry_points(tmp_path, monkeypatch,
                         {registry.ENTRY_POINT_GROUP: {"broken": "support.mru_eviction:nothing"}})
    with pytest.raises(registry.EvictionSelectionError, match="eviction policy 'broken'"):
        make_engine(cpu_blocks=10, extra_config={"eviction": "broken"})


def _first_document_served_from_the_cpu_tier(engine) -> int:
    """Three documents through a CPU tier that holds two, then the first again:
    the tokens of it loaded from the CPU tier."""
    docs = [[(7 * d + i) % 89 + 1 for i in range(DOC_TOKENS)] for d in range(3)]
    for d, doc in enumerate(docs):
        engine.add(f"doc-{d}", doc + [90])
        engine.run_until_done()
        engine.drain()
    # The device cache held them too: empty it, so the lookup asks the CPU tier.
    assert engine.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
    before = engine.offload.totals.data.get("cpu_hit_tokens", 0)
    engine.add("again", docs[0] + [91])
    engine.run_until_done()
    engine.drain()
    assert engine.outputs["again"] is not None
    engine.assert_idle()
    return engine.offload.totals.data.get("cpu_hit_tokens", 0) - before


def test_a_plugged_in_policy_runs_in_an_engine_and_changes_what_is_evicted(make_engine, mru):
    """With a tier of two documents (and vLLM's null block), the third evicts the first
    under ``lru`` (the least recently used) and the second under ``mru`` (the most
    recently released)."""
    lru_engine = make_engine(cpu_blocks=11, extra_config={"eviction": "lru"})
    assert type(lru_engine.offload.cpu.eviction).__name__ == "LruEviction"
    assert _first_document_served_from_the_cpu_tier(lru_engine) == 0

    mru_engine = make_engine(cpu_blocks=11, extra_config={"eviction": "mru"})
    policy = mru_engine.offload.cpu.eviction
    assert isinstance(policy, MruEviction)
    assert _first_document_served_from_the_cpu_tier(mru_engine) == DOC_TOKENS
    assert policy.to_head > 0
