"""Tiers are plug-ins: found by the registry, built from their spec, never named by the core.

``support.memory_tier`` is a whole tier written outside the package; these
tests plug it in by the entry point a third-party package would declare and by
``register_tier``, and run it in an engine.
"""

import logging
import random

import pytest

from kvoffload_hal.config import OffloadConfig
from kvoffload_hal.tiers import registry
from support.entry_points import install_entry_points
from support.memory_tier import ENTRY_POINT, MemoryTier

BS = 16


@pytest.fixture
def memory_tier():
    registry.register_tier("memory", ENTRY_POINT)
    yield
    registry.unregister_tier("memory")


def test_an_entry_point_tier_is_found_with_its_keys(tmp_path, monkeypatch, caplog):
    assert "memory_tier_blocks" not in registry.tier_keys()
    install_entry_points(tmp_path, monkeypatch,
                         {registry.ENTRY_POINT_GROUP: {"memory": ENTRY_POINT}})
    assert registry.tier_targets()["memory"] == ENTRY_POINT
    with caplog.at_level(logging.WARNING):
        config = OffloadConfig.from_extra_config({"memory_tier_blocks": 8})
    assert [t.name for t in config.tiers] == ["memory"] and config.tiers[0].blocks == 8
    assert not any("unknown key" in r.getMessage() for r in caplog.records)


def test_a_tier_validates_its_own_keys(memory_tier):
    with pytest.raises(ValueError, match=r"\['memory_tier_blocks'\]=0"):
        OffloadConfig.from_extra_config({"memory_tier_blocks": 0})


def test_two_tiers_make_a_chain_in_the_order_named(memory_tier, tmp_path):
    disk = {"disk_path": str(tmp_path), "disk_bytes_to_use": 1 << 20}
    both = {**disk, "memory_tier_blocks": 8}
    config = OffloadConfig.from_extra_config({**both, "tiers": ["memory", "disk"]})
    assert [t.name for t in config.tiers] == ["memory", "disk"]
    # Without 'tiers': tiers only this instance writes, in the registry's order.
    assert [t.name for t in OffloadConfig.from_extra_config(both).tiers] == ["disk", "memory"]


@pytest.mark.parametrize("order, message", [
    ("disk", r"\['tiers'\] = 'disk': expected a list of tier names, nearest first"),
    (["disk"], r"leaves out the memory tier, which 'memory_tier_blocks' turns on"),
    (["disk", "memory", "disk"], r"'disk' is named twice"),
    (["disk", "memory", "mooncake"], r"'mooncake' is not turned on \(set 'mooncake_master'\)"),
    (["disk", "tape"], r"'tape' is no known tier; expected a list of tier names"),
])
def test_a_wrong_tier_order_is_refused_naming_the_key(memory_tier, tmp_path, order, message):
    extra = {"disk_path": str(tmp_path), "disk_bytes_to_use": 1 << 20,
             "memory_tier_blocks": 8, "tiers": order}
    with pytest.raises(ValueError, match=message):
        OffloadConfig.from_extra_config(extra)


@pytest.mark.parametrize("target, why", [
    ("support.no_such_module:Spec", "cannot be imported"),
    ("support.memory_tier:MemoryTier", "is not a TierSpec subclass"),
])
def test_a_broken_plug_in_fails_with_its_name(target, why):
    registry.register_tier("broken", target)
    try:
        with pytest.raises(registry.TierSelectionError, match=f"tier 'broken' .*{why}"):
            OffloadConfig.from_extra_config({})
    finally:
        registry.unregister_tier("broken")


def test_built_in_names_are_reserved():
    with pytest.raises(ValueError, match="reserved"):
        registry.register_tier("disk", ENTRY_POINT)


def test_a_plugged_in_tier_serves_hits_in_an_engine(make_engine, memory_tier):
    """Prefixes the CPU tier dropped come back from the plug-in, checked by the fake model."""
    engine = make_engine(cpu_blocks=12, extra_config={"memory_tier_blocks": 200})
    tier = engine.worker.worker.tiers.nearest
    assert isinstance(tier, MemoryTier)
    rng = random.Random(0)
    docs = [[rng.randrange(1, 90) for _ in range(80)] for _ in range(6)]  # 30 blocks
    for p in range(2):
        for i, doc in enumerate(docs):
            engine.add(f"{p}-{i}", doc + [p])
            engine.run_until_done()
            engine.drain()
    assert len(tier.values) == 30  # every block written through
    assert tier.reads >= 6 * 5 - 12  # at least what the CPU tier had to drop
    assert engine.offload.totals.data["cpu_hit_tokens"] == 6 * 80
    engine.assert_idle()


def test_a_model_the_tier_does_not_support_runs_without_it(memory_tier):
    """A tier that declares nothing keeps to one KV cache group; the built-ins
    serve several, as long as their blocks are of one size."""
    from types import SimpleNamespace

    def model(*block_sizes):
        return SimpleNamespace(kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=bs)) for bs in block_sizes])

    spec, = OffloadConfig.from_extra_config({"memory_tier_blocks": 8}).tiers
    assert registry.tier_runs(spec, model(16)) and not registry.tier_runs(spec, model(16, 16))
    assert registry.why_tier_is_off(spec, model(16, 16)) == (
        "the memory tier supports models with one KV cache group")
    disk = registry.spec_class("disk", registry.tier_targets()["disk"])("/tmp", 1)
    assert registry.tier_runs(disk, model(16, 16)) and not registry.tier_runs(disk, model(16, 32))
    assert not registry.tier_runs(None, model(16))
