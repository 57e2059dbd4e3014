"""DiskTier on real files: round trips, integrity failures, eviction, concurrency."""

import os

import pytest
import torch

from kvoffload_hal.tiers.disk import _HEADER, DiskTier
from support.polling import collect_results, wait_until


def _wait(tier, n_jobs):
    """The next ``n_jobs`` results of ``tier``, by job id."""
    return {r.job_id: r for r in collect_results(tier.poll, n_jobs)}


@pytest.fixture(params=[False, True], ids=["buffered", "o_direct"])
def tier(tmp_path, request):
    views = [torch.randint(0, 256, (8, 4096), dtype=torch.uint8),
             torch.randint(0, 256, (8, 1000), dtype=torch.uint8)]  # two host regions
    t = DiskTier(str(tmp_path), rank=3, host_views=views, o_direct=request.param)
    yield t
    t.shutdown()


def test_round_trip_is_byte_exact_into_other_blocks(tier):
    original = [v.clone() for v in tier.views]
    tier.submit_store(0, [("aa01", 1), ("bb02", 2)])
    assert _wait(tier, 1)[0].ok
    for v in tier.views:
        v[5:7] = 0
    tier.submit_load(1, [("aa01", 5), ("bb02", 6)])
    assert _wait(tier, 1)[1].ok
    for v, o in zip(tier.views, original):
        assert torch.equal(v[5], o[1]) and torch.equal(v[6], o[2])
    assert os.path.exists(os.path.join(tier.root, "aa", "aa01.kvb"))
    assert tier.root.endswith("rank3")


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped", "header"])
def test_damaged_entries_fail_their_key_and_leave_the_block_alone(tier, damage):
    tier.submit_store(0, [("cc03", 0), ("dd04", 1)])
    _wait(tier, 1)
    path = os.path.join(tier.root, "cc", "cc03.kvb")
    if damage == "missing":
        os.unlink(path)
    elif damage == "truncated":
        os.truncate(path, _HEADER.size + 100)
    elif damage == "flipped":
        with open(path, "r+b") as f:
            f.seek(_HEADER.size + 77)
            byte = f.read(1)
            f.seek(_HEADER.size + 77)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:
        with open(path, "r+b") as f:
            f.write(b"NOTAKVBL")
    before = [v[4].clone() for v in tier.views]
    tier.submit_load(1, [("cc03", 4), ("dd04", 5)])
    result = _wait(tier, 1)[1]
    assert result.failed_keys == ("cc03",)
    if damage in ("missing", "header"):  # nothing was copied into the block
        assert all(torch.equal(v[4], b) for v, b in zip(tier.views, before))


def test_evict_deletes_files(tier):
    tier.submit_store(0, [("ee05", 0)])
    _wait(tier, 1)
    tier.evict(["ee05", "never-written"])
    path = os.path.join(tier.root, "ee", "ee05.kvb")
    wait_until(lambda: not os.path.exists(path), 5, "the evicted file to be deleted")


def test_many_concurrent_jobs_each_reported_once(tier):
    for job in range(20):
        tier.submit_store(job, [(f"{job:02x}{k}", k % 8) for k in range(4)])
    stored = _wait(tier, 20)
    assert all(r.ok for r in stored.values())
    for job in range(20, 40):
        tier.submit_load(job, [(f"{job - 20:02x}{k}", (k + 1) % 8) for k in range(4)])
    loaded = _wait(tier, 20)
    assert sorted(loaded) == list(range(20, 40)) and all(r.ok for r in loaded.values())
    assert tier.poll() == [] and tier.num_pending == 0


def test_start_up_wipes_what_an_earlier_run_left(tmp_path):
    views = [torch.zeros(2, 64, dtype=torch.uint8)]
    first = DiskTier(str(tmp_path), 0, views)
    first.submit_store(0, [("ff06", 0)])
    _wait(first, 1)
    first.shutdown()
    second = DiskTier(str(tmp_path), 0, views)
    assert not os.path.exists(os.path.join(second.root, "ff", "ff06.kvb"))
    second.shutdown()


def test_unwritable_disk_path_is_a_start_up_error(tmp_path):
    from kvoffload_hal.config import OffloadConfig

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"disk_path.*expected a writable directory"):
        OffloadConfig.from_extra_config({"disk_path": str(blocker / "sub"),
                                         "disk_bytes_to_use": 1 << 20})


def test_files_and_directories_are_private_to_the_serving_user(tier):
    tier.submit_store(0, [("cc03", 1)])
    assert _wait(tier, 1)[0].ok
    path = tier._path("cc03")
    assert os.stat(path).st_mode & 0o777 == 0o600  # KV reveals the prompts
    for directory in (os.path.dirname(path), tier.root):
        assert os.stat(directory).st_mode & 0o777 == 0o700


@pytest.mark.parametrize("error", [MemoryError, ValueError, OSError])
def test_any_fault_in_a_tier_job_fails_its_key_not_the_step(tier, monkeypatch, error):
    tier.submit_store(0, [("dd04", 1)])
    assert _wait(tier, 1)[0].ok

    def broken(*args):
        raise error("injected")

    monkeypatch.setattr(tier, "_read_file", broken)
    monkeypatch.setattr(tier, "_write_file", broken)
    tier.submit_load(1, [("dd04", 2)])
    tier.submit_store(2, [("ee05", 3)])
    results = _wait(tier, 2)  # poll() raised before, failing the engine step
    assert results[1].failed_keys == ("dd04",) and results[2].failed_keys == ("ee05",)
