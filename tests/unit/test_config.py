"""kv_connector_extra_config validation: one clear error per bad value, one warning for
unknown keys."""

import logging
import os

import pytest

from kvoffload_hal.config import DEFAULT_CPU_BYTES_TO_USE, OffloadConfig, num_cpu_blocks


def test_defaults():
    config = OffloadConfig.from_extra_config(None)
    assert config == OffloadConfig(DEFAULT_CPU_BYTES_TO_USE, False)
    assert config.cpu_bytes_per_rank(4) == DEFAULT_CPU_BYTES_TO_USE // 4


@pytest.mark.parametrize("value", [0, -1, 1.5, "1GiB", True, None])
def test_cpu_bytes_to_use_must_be_a_positive_int(value):
    with pytest.raises(ValueError) as e:
        OffloadConfig.from_extra_config({"cpu_bytes_to_use": value})
    message = str(e.value)
    assert "cpu_bytes_to_use" in message and repr(value) in message
    assert "expected an integer number of bytes > 0" in message
    assert "\n" not in message


@pytest.mark.parametrize("value", [1, "true", None])
def test_lazy_offload_must_be_a_bool(value):
    with pytest.raises(ValueError, match=r"lazy_offload.*expected true or false"):
        OffloadConfig.from_extra_config({"lazy_offload": value})


@pytest.mark.parametrize("key, value, choices", [
    *[("load_mode", v, "auto, async, sync") for v in ("SYNC", "blocking", 1, None)],
    *[("eviction", v, "lru, adaptive") for v in ("LRU", "arc", 1, None)],
    *[("device_copies", v, "keep, drop") for v in ("drop_stored", "DROP", None)],
])
def test_a_choice_must_be_one_of_its_values(key, value, choices):
    with pytest.raises(ValueError) as e:
        OffloadConfig.from_extra_config({key: value})
    expected = f"kv_connector_extra_config['{key}']={value!r}: expected one of {choices}"
    assert str(e.value) == expected


def test_eviction_defaults_to_lru_and_adaptive_is_selectable():
    assert OffloadConfig.from_extra_config(None).eviction == "adaptive"
    assert OffloadConfig.from_extra_config({"eviction": "adaptive"}).eviction == "adaptive"


def test_unknown_keys_give_one_warning_listing_valid_keys(caplog):
    with caplog.at_level(logging.WARNING):
        config = OffloadConfig.from_extra_config(
            {"cpu_bytes": 5, "lazy": True, "lazy_offload": True})
    assert config.lazy_offload is True
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "cpu_bytes, lazy" in text and "cpu_bytes_to_use, lazy_offload" in text


def test_capacity_below_one_block_is_an_error():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from support.engine_harness import HEAD_DIM, HEADS  # noqa: F401 (vLLM env set-up)

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    cfg = KVCacheConfig(num_blocks=10, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)])
    per_block = 2 * spec.page_size_bytes  # two layers
    assert num_cpu_blocks(cfg, 3 * per_block + 1) == 3
    with pytest.raises(ValueError, match=rf"less than one KV block \({per_block} bytes\)"):
        num_cpu_blocks(cfg, per_block - 1)


def test_a_missing_disk_path_is_created_private(tmp_path):
    path = tmp_path / "kv"
    OffloadConfig.from_extra_config({"disk_path": str(path), "disk_bytes_to_use": 1 << 20})
    assert os.stat(path).st_mode & 0o777 == 0o700


def test_disk_keys_without_disk_path_are_errors():
    for key, value in (("disk_bytes_to_use", 1 << 20), ("disk_o_direct", True)):
        with pytest.raises(ValueError) as e:
            OffloadConfig.from_extra_config({key: value})
        assert str(e.value) == (f"kv_connector_extra_config['{key}'] is set but 'disk_path' "
                                "is not: expected both for a disk tier")
    assert not OffloadConfig.from_extra_config({"disk_o_direct": False}).tiers


def test_disk_path_expands_home_and_refuses_relative_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    config = OffloadConfig.from_extra_config({"disk_path": "~/kv", "disk_bytes_to_use": 1 << 20})
    assert config.tiers[0].path == str(tmp_path / "kv") and (tmp_path / "kv").is_dir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        OffloadConfig.from_extra_config({"disk_path": "kv", "disk_bytes_to_use": 1 << 20})
    assert str(e.value) == ("kv_connector_extra_config['disk_path']='kv': expected an absolute "
                            "path (or one starting with ~)")


def _memory(monkeypatch, total_gib, available_gib):
    from kvoffload_hal import config as config_module

    sizes = {"MemTotal": total_gib << 30, "MemAvailable": available_gib << 30}
    monkeypatch.setattr(config_module, "host_memory", sizes.__getitem__)


def test_a_cpu_tier_larger_than_the_host_is_refused_with_its_numbers(monkeypatch):
    from kvoffload_hal.config import check_capacity

    _memory(monkeypatch, total_gib=64, available_gib=8)
    huge = OffloadConfig.from_extra_config({"cpu_bytes_to_use": 2**70})
    with pytest.raises(ValueError) as e:
        check_capacity(huge, 1, before_allocating=False)
    assert str(e.value) == (
        "kv_connector_extra_config['cpu_bytes_to_use'] gives 1180591620717411303424 bytes per "
        "rank (1099511627776.0 GiB), more than the 64.0 GiB of memory on this host: expected "
        "at most 68719476736 bytes per rank (or set 'allow_overcommit': true)")
    # Each rank checks its share against what is available before it allocates.
    check_capacity(OffloadConfig.from_extra_config({"cpu_bytes_to_use": 16 << 30}), 2,
                   before_allocating=True)
    with pytest.raises(ValueError, match=r"more than the 8\.0 GiB of memory available"):
        check_capacity(OffloadConfig.from_extra_config({"cpu_bytes_to_use": 17 << 30}), 2,
                       before_allocating=True)
    overcommitted = OffloadConfig.from_extra_config({"cpu_bytes_to_use": 2**70,
                                                     "allow_overcommit": True})
    check_capacity(overcommitted, 1, before_allocating=True)  # a warning, on purpose


def test_a_disk_tier_larger_than_the_free_space_is_refused(tmp_path, monkeypatch):
    from kvoffload_hal.config import check_capacity

    _memory(monkeypatch, total_gib=64, available_gib=64)
    config = OffloadConfig.from_extra_config({"cpu_bytes_to_use": 1 << 20,
                                              "disk_path": str(tmp_path),
                                              "disk_bytes_to_use": 2**70})
    with pytest.raises(ValueError, match=rf"disk_bytes_to_use'\] gives .* free in {tmp_path}"):
        check_capacity(config, 1, before_allocating=True)


def test_an_engine_refuses_an_impossible_tier_before_building_it(make_engine):
    with pytest.raises(ValueError, match=r"cpu_bytes_to_use'\] gives .* memory on this host"):
        make_engine(cpu_blocks=2**50)  # an index of 2**50 blocks would never finish


def test_prefetch_defaults_and_values():
    config = OffloadConfig.from_extra_config(None)
    assert (config.prefetch_requests, config.prefetch_cpu_share, config.prefetch_blocks) == (
        4, 0.25, 0)
    config = OffloadConfig.from_extra_config(
        {"prefetch_requests": 0, "prefetch_cpu_share": 1, "prefetch_blocks": 64})
    assert (config.prefetch_requests, config.prefetch_cpu_share, config.prefetch_blocks) == (
        0, 1.0, 64)


@pytest.mark.parametrize("key, value, expected", [
    *[("prefetch_requests", v, "expected an integer number of requests >= 0")
      for v in (-1, 1.5, "4", True, None)],
    *[("prefetch_blocks", v, "expected an integer number of blocks >= 0")
      for v in (-1, 2.0, "64", False)],
    *[("prefetch_cpu_share", v, "expected a number > 0 and <= 1")
      for v in (0, -0.1, 1.5, "0.25", True, None)],
])
def test_prefetch_keys_are_validated(key, value, expected):
    with pytest.raises(ValueError) as e:
        OffloadConfig.from_extra_config({key: value})
    assert str(e.value) == f"kv_connector_extra_config['{key}']={value!r}: {expected}"


def test_each_data_parallel_rank_counts_the_local_ranks_it_knows_of():
    from types import SimpleNamespace

    from kvoffload_hal.config import local_replicas

    # A dense model: vLLM runs each rank as an engine of its own and tells it it is
    # alone (size 1), but leaves it its local index; the last rank knows of them all.
    dense = [SimpleNamespace(data_parallel_size_local=1, data_parallel_rank_local=i)
             for i in range(4)]
    assert [local_replicas(p) for p in dense] == [1, 2, 3, 4]
    # A MoE model: the ranks run in lockstep and each knows the local count.
    moe = SimpleNamespace(data_parallel_size_local=4, data_parallel_rank_local=0)
    assert local_replicas(moe) == 4
    single = SimpleNamespace(data_parallel_size_local=1, data_parallel_rank_local=None)
    assert local_replicas(single) == 1


def test_shutdown_flush_timeout_defaults_to_two_seconds_and_zero_is_allowed():
    assert OffloadConfig.from_extra_config(None).shutdown_flush_timeout_s == 2.0
    config = OffloadConfig.from_extra_config({"shutdown_flush_timeout_s": 0})
    assert config.shutdown_flush_timeout_s == 0.0


@pytest.mark.parametrize("value", [-1, -0.5, "2", True, None, float("nan")])
def test_shutdown_flush_timeout_is_validated(value):
    with pytest.raises(ValueError) as e:
        OffloadConfig.from_extra_config({"shutdown_flush_timeout_s": value})
    assert str(e.value) == (f"kv_connector_extra_config['shutdown_flush_timeout_s']={value!r}: "
                            "expected a number of seconds >= 0")
