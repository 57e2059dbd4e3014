"""DiskTier on real files: round trips, integrity failures, eviction, concurrency."""

import os
import shutil

import pytest
import torch

from kvoffload_hal.tiers.block_value import HEADER as _HEADER
from kvoffload_hal.tiers.disk.worker import DiskTier
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
    assert os.path.basename(tier.root).startswith("rank3.")


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


def _files(root, suffix):
    return [name for _, _, names in os.walk(root) for name in names if name.endswith(suffix)]


def test_a_file_is_tied_to_its_key_and_to_the_writers_fingerprint(tmp_path):
    def make(fingerprint):
        return DiskTier(str(tmp_path), 0, [torch.full((2, 64), fingerprint[0], dtype=torch.uint8)],
                        fingerprint=fingerprint)

    writer, same, other = make(b"a" * 32), make(b"a" * 32), make(b"b" * 32)
    writer.submit_store(0, [("aa01", 0), ("bb02", 1)])
    assert _wait(writer, 1)[0].ok
    source = os.path.join(writer.root, "aa", "aa01.kvb")
    for tier in (same, other):
        for key in ("aa01", "cc03"):  # under its own name, and copied over another key's
            os.makedirs(os.path.join(tier.root, key[:2]), exist_ok=True)
            shutil.copy(source, tier._path(key))
        tier.submit_load(1, [("aa01", 0), ("cc03", 1)])
    assert _wait(same, 1)[1].failed_keys == ("cc03",)  # the right key and model: accepted
    assert _wait(other, 1)[1].failed_keys == ("aa01", "cc03")  # another model's KV: refused
    for tier in (writer, same, other):
        tier.shutdown()


def test_the_checksum_covers_the_header(tier):
    tier.submit_store(0, [("dd04", 0)])
    _wait(tier, 1)
    with open(tier._path("dd04"), "r+b") as f:
        f.seek(18)  # the reserved field: read by nothing but the checksum
        f.write(b"\xff\xff")
    tier.submit_load(1, [("dd04", 1)])
    assert _wait(tier, 1)[1].failed_keys == ("dd04",)


def test_a_failed_write_leaves_no_temporary_file(tier, monkeypatch):
    def fails_half_way(path, data):
        with open(path, "wb") as f:
            f.write(data[:100])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tier, "_write_file", fails_half_way)
    tier.submit_store(0, [("ee05", 0)])
    assert _wait(tier, 1)[0].failed_keys == ("ee05",)
    assert _files(tier.root, ".tmp") == [] and _files(tier.root, ".kvb") == []


def test_a_short_direct_write_fails_its_key(tmp_path, monkeypatch):
    tier = DiskTier(str(tmp_path), 0, [torch.ones(2, 5000, dtype=torch.uint8)], o_direct=True)
    real_write = os.write

    def short_write(fd, data):  # a full disk accepts part of the (page-aligned) buffer
        return real_write(fd, memoryview(data)[:4096])

    monkeypatch.setattr(os, "write", short_write)
    tier.submit_store(0, [("ff06", 0)])
    result = _wait(tier, 1)[0]
    monkeypatch.undo()
    assert result.failed_keys == ("ff06",)
    assert _files(tier.root, ".tmp") == [] and _files(tier.root, ".kvb") == []
    tier.shutdown()


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

    monkeypatch.setattr(tier, "_read_block", broken)
    monkeypatch.setattr(tier, "_write_file", broken)
    tier.submit_load(1, [("dd04", 2)])
    tier.submit_store(2, [("ee05", 3)])
    results = _wait(tier, 2)  # poll() raised before, failing the engine step
    assert results[1].failed_keys == ("dd04",) and results[2].failed_keys == ("ee05",)


def test_shutdown_with_hung_io_returns_within_its_timeout(tmp_path, monkeypatch):
    import threading
    import time

    tier = DiskTier(str(tmp_path), 0, [torch.ones(2, 64, dtype=torch.uint8)])
    release = threading.Event()
    monkeypatch.setattr(tier, "_read_block", lambda key: release.wait() and b"")  # a hung mount
    tier.submit_load(0, [("ab01", 0)])
    start = time.monotonic()
    assert tier.shutdown(timeout_s=0.2) is False  # the caller keeps the host memory alive
    assert time.monotonic() - start < 2.0
    assert os.path.isdir(tier.root)  # not removed under a running IO
    release.set()
