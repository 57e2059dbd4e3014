"""Warm restart of the disk tier: a new engine on the same ``disk_path`` serves the blocks
a stopped one kept, and only those that are valid for it.

Engines of the harness (vLLM's real scheduler, both connector roles, a fake model
that checks every KV read) one after another on one directory.
"""

import os
import random

import pytest

from kvoffload_hal.tiers.disk.dirs import FINGERPRINT, LOCK, MARKER, TierDir

BS = 16
PAGE = BS * 128  # one harness block: 16 tokens x 128 bytes of K and V
NUM_DOCS, DOC_TOKENS = 6, 80  # 5 blocks each, 30 in all


@pytest.fixture(autouse=True)
def fixed_hash_seed(monkeypatch):
    """Block hashes are the same in every engine only with a fixed seed."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")


def _engine(make_engine, tmp_path, disk_blocks=200, **extra):
    return make_engine(cpu_blocks=12, extra_config={
        "disk_path": str(tmp_path / "kv"), "disk_bytes_to_use": disk_blocks * PAGE, **extra})


def _docs():
    rng = random.Random(0)
    return [[rng.randrange(1, 90) for _ in range(DOC_TOKENS)] for _ in range(NUM_DOCS)]


def _serve_all(engine, tag, suffix=()):
    for i, doc in enumerate(_docs()):
        engine.add(f"{tag}{i}", doc + list(suffix))
        engine.run_until_done()
        engine.drain()
    return [engine.outputs[f"{tag}{i}"] for i in range(NUM_DOCS)]


def _first_engine(make_engine, tmp_path, **extra):
    engine = _engine(make_engine, tmp_path, **extra)
    outputs = _serve_all(engine, "a")
    assert engine.offload.totals.data["blocks_to_disk"] == NUM_DOCS * DOC_TOKENS // BS
    engine.close()  # a clean shutdown
    return outputs


def _block_files(tmp_path):
    return [f for _, _, files in os.walk(tmp_path / "kv") for f in files if f.endswith(".kvb")]


def test_a_restarted_engine_serves_the_blocks_its_predecessor_kept(make_engine, tmp_path):
    _first_engine(make_engine, tmp_path)
    assert len(_block_files(tmp_path)) == NUM_DOCS * DOC_TOKENS // BS
    engine = _engine(make_engine, tmp_path)
    # The index is whole at start-up (the workers' handshake), before any step.
    assert engine.steps == 0 and not engine.offload.tiers.nearest.rebuild.pending
    assert engine.offload.tiers.nearest.rebuild.adopted == NUM_DOCS * DOC_TOKENS // BS
    _serve_all(engine, "b", suffix=[7])  # every full block of each document is a hit
    assert engine.cached_tokens["b0"] == DOC_TOKENS  # the very first request too
    totals = engine.offload.totals.data
    assert totals["blocks_from_disk"] == NUM_DOCS * DOC_TOKENS // BS
    assert totals["cpu_hit_tokens"] == NUM_DOCS * DOC_TOKENS  # every block, every read checked
    engine.assert_idle()


def test_a_listing_longer_than_the_start_up_wait_goes_on_with_the_steps(
        make_engine, tmp_path, monkeypatch):
    import threading

    from kvoffload_hal.tiers.disk.rebuild import DirScan
    from kvoffload_hal.worker import core

    _first_engine(make_engine, tmp_path)
    gate, listing = threading.Event(), DirScan._list
    monkeypatch.setattr(DirScan, "_list", lambda self: gate.wait() and listing(self))
    monkeypatch.setattr(core, "FOUND_AT_START_WAIT_S", 0.2)  # a slow disk at start-up
    engine = _engine(make_engine, tmp_path)
    rebuild = engine.offload.tiers.nearest.rebuild
    assert rebuild.pending and rebuild.adopted == 0  # start-up did not wait for ever
    gate.set()
    engine.drain()  # what the listing finds later comes in the step metadata
    assert not rebuild.pending and rebuild.adopted == NUM_DOCS * DOC_TOKENS // BS


def test_a_block_some_rank_lacks_is_never_indexed_and_its_files_go(make_engine, tmp_path):
    """Two ranks: the harness's worker plays rank 0, this test reports rank 1's handshake
    (the same keys as vLLM's engine core would gather), which lacks half the blocks."""
    from kvoffload_hal.metadata import OffloadHandshake

    _first_engine(make_engine, tmp_path)
    keys = sorted(f[:-len(".kvb")] for f in _block_files(tmp_path))
    engine = make_engine(cpu_blocks=12, ranks=2, extra_config={
        "disk_path": str(tmp_path / "kv"), "disk_bytes_to_use": 2 * 200 * PAGE})
    rebuild = engine.offload.tiers.nearest.rebuild
    assert rebuild.pending and rebuild.adopted == 0  # rank 0 alone holds nothing whole
    engine.connector.set_xfer_handshake_metadata_pp_aware(
        {(0, 1): OffloadHandshake([(0, k) for k in keys[:15]], tier_scans_done=[0])})
    index = engine.offload.tiers.nearest.index
    assert not rebuild.pending and rebuild.adopted == 15
    assert all(index.is_ready(k) for k in keys[:15])
    assert not any(k in index for k in keys[15:])
    assert sorted(engine.offload.tiers.nearest.take_jobs().evictions) == keys[15:]


def test_with_retention_remove_a_restart_starts_empty(make_engine, tmp_path):
    _first_engine(make_engine, tmp_path, disk_retention="remove")
    assert _block_files(tmp_path) == []  # removed at the clean shutdown
    engine = _engine(make_engine, tmp_path, disk_retention="remove")
    _serve_all(engine, "b", suffix=[7])
    assert engine.offload.totals.data.get("blocks_from_disk", 0) == 0


def test_another_fingerprint_never_adopts_and_removes_the_old_blocks(
        make_engine, tmp_path, monkeypatch):
    _first_engine(make_engine, tmp_path)
    monkeypatch.setenv("PYTHONHASHSEED", "1")  # other block hashes: other fingerprint
    engine = _engine(make_engine, tmp_path)
    engine.drain()
    assert engine.offload.tiers.nearest.rebuild.adopted == 0
    _serve_all(engine, "b", suffix=[7])
    assert engine.offload.totals.data.get("blocks_from_disk", 0) == 0
    # Only the new engine's own directory is left.
    assert len([d for d in os.listdir(tmp_path / "kv") if d.startswith("rank")]) == 1


def test_a_smaller_tier_after_the_restart_keeps_the_newest_blocks(make_engine, tmp_path):
    _first_engine(make_engine, tmp_path)
    engine = _engine(make_engine, tmp_path, disk_blocks=12)
    engine.drain()
    engine.step()  # the evictions reach the worker, which deletes their files
    engine.drain()
    worker_tier = engine.worker.worker.tiers.nearest
    worker_tier.shutdown()  # wait for the deletions
    assert engine.offload.tiers.nearest.rebuild.adopted == 30
    assert len(engine.offload.tiers.nearest.index) == 12
    assert len(_block_files(tmp_path)) == 12


def test_unfinished_writes_of_a_killed_server_are_removed_and_never_served(tmp_path):
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    fingerprint = bytes(range(32))
    old = TierDir(str(root), 0, fingerprint, adopt=True)
    sub = os.path.join(old.path, "ab")
    os.mkdir(sub, 0o700)
    with open(os.path.join(sub, "ab01.kvb"), "wb") as f:
        f.write(b"x")
    with open(os.path.join(sub, "ab02.kvb.77.tmp"), "wb") as f:
        f.write(b"half")
    os.close(old._lock_fd)  # killed: the kernel drops the lock, nothing is removed
    old._lock_fd = None
    new = TierDir(str(root), 0, fingerprint, adopt=True)
    assert new.adopted and new.path == old.path
    from kvoffload_hal.tiers.disk.rebuild import DirScan

    scan = DirScan(new.path)
    scan.join(10)
    assert scan.take() == (["ab01"], True)
    assert scan.removed_temporaries == 1
    assert not os.path.exists(os.path.join(sub, "ab02.kvb.77.tmp"))
    new.close(remove=False)


def test_two_servers_starting_at_once_never_adopt_the_same_directory(tmp_path):
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    fingerprint = b"\x01" * 32
    first = TierDir(str(root), 0, fingerprint, adopt=True)
    first.close(remove=False)  # stopped, kept
    a = TierDir(str(root), 0, fingerprint, adopt=True)
    b = TierDir(str(root), 0, fingerprint, adopt=True)  # the kept one is locked by a
    assert a.adopted and a.path == first.path
    assert not b.adopted and b.path != a.path
    for d in (a.path, b.path):
        assert {MARKER, LOCK, FINGERPRINT} <= set(os.listdir(d))
    a.close(remove=False)
    b.close(remove=True)


def test_with_a_random_hash_seed_nothing_is_adopted_and_one_line_says_why(
        make_engine, tmp_path, monkeypatch, caplog):
    """vLLM 0.23 seeds block hashes at random without PYTHONHASHSEED (0.32 does for
    sha256 only with xxhash): kept blocks could never be found again."""
    from kvoffload_hal.tiers.identity import block_hash_seed_is_random

    monkeypatch.delenv("PYTHONHASHSEED")
    random_seed = block_hash_seed_is_random("sha256")
    _first_engine(make_engine, tmp_path)
    caplog.clear()
    with caplog.at_level("WARNING"):
        engine = _engine(make_engine, tmp_path)
        engine.drain()
    said = [r.getMessage() for r in caplog.records if "PYTHONHASHSEED" in r.getMessage()]
    assert len(said) == (1 if random_seed else 0)
    assert engine.offload.tiers.nearest.rebuild.adopted == (0 if random_seed else 30)
