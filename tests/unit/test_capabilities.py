"""Capabilities are resolved once, from the KV cache config, the config and the backend."""

from types import SimpleNamespace

import pytest

from kvoffload_hal.capabilities import LoadRecovery, resolve_capabilities
from kvoffload_hal.config import OffloadConfig
from support import backend_doubles  # noqa: F401 (registers the test backends)


def _groups(n, block_sizes=None):
    sizes = block_sizes or [16] * n
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=sizes[g])) for g in range(n)])


def _caps(num_groups, backend="cpu", **extra):
    return resolve_capabilities(_groups(num_groups), OffloadConfig.from_extra_config(extra),
                                backend=backend)


def test_models_with_several_kv_cache_groups_are_accepted_on_every_vllm():
    caps = _caps(2)
    assert not caps.single_group and not caps.sync_loads
    assert caps.load_recovery is not LoadRecovery.BLOCKS  # block ids are per group


def test_load_mode_sync_needs_one_kv_cache_group():
    assert _caps(1, load_mode="sync").sync_loads
    assert not _caps(1, load_mode="async").sync_loads
    with pytest.raises(ValueError) as e:
        _caps(2, load_mode="sync")
    assert str(e.value) == ("kv_connector_extra_config['load_mode']='sync': expected a model "
                            "with one KV cache group, this one has 2; use 'async' or 'auto'")


def test_auto_loads_follow_the_backends_synchronous_compute():
    # The CPU backend's forward pass has finished when copies start; slow-cpu
    # plays a device whose compute overlaps the copies.
    assert _caps(1, "cpu").synchronous_compute and _caps(1, "cpu").sync_loads
    assert not _caps(1, "slow-cpu").synchronous_compute
    assert not _caps(1, "slow-cpu").sync_loads
    assert not _caps(2, "cpu").sync_loads  # a failed sync load maps to blocks of one group


def test_the_disk_tier_serves_several_groups_of_one_block_size(tmp_path):
    disk = {"disk_path": str(tmp_path), "disk_bytes_to_use": 1 << 20}
    one, two = _caps(1, **disk), _caps(2, **disk)
    assert one.tiers == ("disk",) and one.load_recovery is LoadRecovery.BLOCKS
    # One entry per (group, block); failed loads are reported per request.
    assert two.tiers == ("disk",) and two.load_recovery is not LoadRecovery.BLOCKS
    config = OffloadConfig.from_extra_config(disk)
    mixed = resolve_capabilities(_groups(2, [16, 32]), config, backend="cpu")
    assert mixed.tiers == ()
    assert _caps(1).tiers == ()  # no disk_path


def test_a_missing_backend_fails_with_its_name():
    from kvoffload_hal.hal import BackendSelectionError

    with pytest.raises(BackendSelectionError, match="'nonexistent' is not a known backend"):
        _caps(1, "nonexistent")


# What a release tells the strategy's choice, by name (as vllm_compat detects it).
RELEASE_FACTS = ("REPORTS_FAILED_RECVING", "STEPS_FOR_PUSH_WORK", "HAS_TRANSFER_RESULTS")


@pytest.mark.parametrize("newer", [True, False], ids=["vllm-0.32-on", "vllm-0.23-to-0.31"])
def test_the_vllm_strategy_is_chosen_once_from_the_release_and_the_groups(monkeypatch,
                                                                          newer):
    """Both releases' choice on every lane: the release's facts are set as vllm_compat
    would detect them there."""
    from kvoffload_hal import vllm_compat

    for fact in RELEASE_FACTS:
        monkeypatch.setattr(vllm_compat, fact, newer)
    host_hits = object()  # what that release counts the connector's hits as
    monkeypatch.setattr(vllm_compat, "HOST_HIT_SOURCE", host_hits if newer else None)
    monkeypatch.setattr(vllm_compat, "block_holders_first", lambda: newer)
    one, two = _caps(1).vllm, _caps(2).vllm
    assert one.load_recovery is LoadRecovery.BLOCKS
    assert two.load_recovery is (LoadRecovery.REQUESTS if newer else LoadRecovery.RETRY)
    assert _caps(2).load_recovery is two.load_recovery
    # Only where a failed load is sent again is a staged hit checked before it is offered.
    assert two.checks_staged_hits_first() is (not newer) and not one.checks_staged_hits_first()
    assert (two.recovery_notice() is None) is newer and one.recovery_notice() is None
    for strategy in (one, two):
        assert strategy.holds_last_request() is (not newer)
        assert strategy.tracks_landed_loads() is (not newer)
        assert strategy.hit_source() is (host_hits if newer else None)


def test_failed_loads_go_back_to_the_scheduler_side_only_where_they_are_sent_again():
    two = _caps(2).vllm
    sent, recomputed = [], []
    two.on_failed_loads({"r"}, sent.append, recomputed.append)
    retry = two.load_recovery is LoadRecovery.RETRY
    assert (sent, recomputed) == (([{"r"}], []) if retry else ([], [{"r"}]))
