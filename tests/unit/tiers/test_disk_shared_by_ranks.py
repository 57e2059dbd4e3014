"""``disk_shared``: live engines with one fingerprint read each other's blocks from one
``disk_path`` (the data-parallel ranks of a host), each writing and deleting only its own
files. Engines on vLLM's real scheduler in the engine harness; every KV read is checked
by the fake model, so a block served from a peer's file is byte-exact or the test fails."""

import os
import shutil
import threading

import pytest
import torch

from kvoffload_hal.config import OffloadConfig
from kvoffload_hal.tiers.disk.worker import DiskTier
from support.polling import collect_results, wait_until

BS = 16
PAGE = BS * 128  # one harness block: 16 tokens x 128 bytes of K and V
DOC_BLOCKS = 5


@pytest.fixture(autouse=True)
def one_hash_seed(monkeypatch):
    # Engines that share blocks must name them alike (vLLM 0.23 draws a random
    # block-hash seed per engine otherwise); the seed is part of the fingerprint.
    monkeypatch.setenv("PYTHONHASHSEED", "0")


def _extra(disk_path, shared=True, disk_blocks=64):
    return {"disk_path": str(disk_path), "disk_bytes_to_use": disk_blocks * PAGE,
            "disk_shared": shared}


def _engine(make_engine, disk_path, **kwargs):
    return make_engine(cpu_blocks=64, num_gpu_blocks=24,
                       extra_config=_extra(disk_path, **kwargs))


def _doc(seed, blocks=DOC_BLOCKS):
    return [(seed * 13 + i * 5) % 89 + 1 for i in range(blocks * BS + 1)]


def _serve(engine, req_id, prompt):
    engine.add(req_id, prompt)
    engine.run_until_done()
    engine.drain()


def _count(engine, key):
    return engine.offload.totals.data.get(key, 0)


def _block_files(engine):
    root = engine.worker.worker.tiers.nearest.root
    return sorted(os.path.join(d, n) for d, _, files in os.walk(root)
                  for n in files if n.endswith(".kvb"))


@pytest.mark.parametrize("shared", [True, False])
def test_an_engine_serves_the_blocks_a_live_peer_wrote(make_engine, tmp_path, shared):
    writer = _engine(make_engine, tmp_path / "kv", shared=shared)
    reader = _engine(make_engine, tmp_path / "kv", shared=shared)
    _serve(writer, "a", _doc(1))
    assert _count(writer, "blocks_to_disk") == DOC_BLOCKS
    written = {p: open(p, "rb").read() for p in _block_files(writer)}
    _serve(reader, "b", _doc(1))
    assert reader.outputs["b"] == writer.outputs["a"]
    if not shared:  # the default: servers on one disk_path never read each other's files
        assert reader.cached_tokens["b"] == 0 and _count(reader, "blocks_from_disk") == 0
        return
    # Every full block came from the writer's files (the fake model checked each byte
    # of the KV read), and the reader wrote none of its own.
    assert reader.cached_tokens["b"] == DOC_BLOCKS * BS
    assert _count(reader, "blocks_from_disk") == DOC_BLOCKS
    assert _count(reader, "blocks_to_disk") == 0 and _block_files(reader) == []
    assert {p: open(p, "rb").read() for p in _block_files(writer)} == written
    reader.assert_idle()
    writer.assert_idle()


def test_a_block_the_writer_evicts_between_lookup_and_read_is_recomputed(
        make_engine, tmp_path):
    # The writer's tier holds 6 blocks: a second document evicts the first one's files.
    writer = _engine(make_engine, tmp_path / "kv", disk_blocks=6)
    reader = _engine(make_engine, tmp_path / "kv")
    doc = _doc(1)
    _serve(writer, "a", doc)
    files = _block_files(writer)
    assert len(files) == DOC_BLOCKS
    tier = reader.worker.worker.tiers.nearest
    gate = threading.Event()
    load = tier._load_batch
    tier._load_batch = lambda items: (gate.wait(30), load(items))[1]
    try:
        reader.add("b", doc)
        for _ in range(50):  # the existence query answers; the read waits at the gate
            reader.step()
            if reader.offload.tiers.nearest.index.ready_run(_keys(reader, "b")):
                break
        assert reader.offload.tiers.nearest.index.ready_run(_keys(reader, "b")) == DOC_BLOCKS
        for seed in (2, 3):  # the writer evicts and deletes "a"'s files
            _serve(writer, f"other{seed}", _doc(seed))
        wait_until(lambda: not any(os.path.exists(p) for p in files), 10,
                   "the writer's deletions")
    finally:
        gate.set()
    reader.run_until_done()
    reader.drain()
    assert reader.outputs["b"] == writer.outputs["a"]
    assert reader.cached_tokens["b"] == 0  # recomputed, every KV read checked
    assert _count(reader, "blocks_from_disk") == 0
    reader.assert_idle()


def _keys(engine, req_id):
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    req = engine.scheduler.requests[req_id]
    return [make_block_hash_with_group_id(h, 0).hex() for h in req.block_hashes]


@pytest.mark.parametrize("damage", ["truncated", "bit flipped"])
def test_a_damaged_peer_file_is_refused_recomputed_and_left_alone(
        make_engine, tmp_path, damage):
    writer = _engine(make_engine, tmp_path / "kv")
    reader = _engine(make_engine, tmp_path / "kv")
    writer.add("a", _doc(1))
    keys = _keys(writer, "a")
    writer.run_until_done()
    writer.drain()
    root = writer.worker.worker.tiers.nearest.root
    bad = os.path.join(root, keys[2][:2], f"{keys[2]}.kvb")
    with open(bad, "r+b") as f:
        if damage == "truncated":  # as a write cut short would leave it
            f.truncate(os.path.getsize(bad) // 2)
        else:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 1]))
    damaged = open(bad, "rb").read()
    _serve(reader, "b", _doc(1))
    assert reader.outputs["b"] == writer.outputs["a"]
    # The blocks before the damaged one came from the writer's files; the rest were
    # recomputed (a prefix hit is contiguous).
    assert reader.cached_tokens["b"] == 2 * BS
    assert _count(reader, "blocks_from_disk") == 2
    assert open(bad, "rb").read() == damaged  # the writer's file: never deleted by a reader
    reader.assert_idle()


def test_a_peer_with_another_fingerprint_is_never_read(make_engine, tiny_model_dir,
                                                       tmp_path):
    from support.engine_harness import Engine

    writer = _engine(make_engine, tmp_path / "kv")
    _serve(writer, "a", _doc(1))
    other_model = shutil.copytree(tiny_model_dir, tmp_path / "other-model")  # other path
    reader = Engine(str(other_model), block_size=BS, num_gpu_blocks=24, cpu_blocks=64,
                    extra_config=_extra(tmp_path / "kv"))
    try:
        reader.model.load_weights(b"other weights")  # a read of the writer's KV: wrong bytes
        assert reader.worker.worker.tiers.nearest.peers.paths() == ()
        _serve(reader, "b", _doc(1))
        assert reader.cached_tokens["b"] == 0 and _count(reader, "blocks_from_disk") == 0
        assert len(reader.outputs["b"]) == 4
    finally:
        reader.close()


# ------------------------------------------------------- the worker half alone
def _tier(root, fill, fingerprint=bytes(32)):
    views = [torch.full((4, 64), fill, dtype=torch.uint8)]
    return DiskTier(str(root), 0, views, fingerprint=fingerprint, shared=True)


def test_peer_reads_are_byte_exact_and_follow_no_link(tmp_path):
    writer, reader = _tier(tmp_path, 7), _tier(tmp_path, 0)
    writer.views[0][1] = torch.arange(64, dtype=torch.uint8)
    writer.submit_store(0, [("ab01", 1), ("ab02", 1), ("ab03", 1)])
    assert collect_results(writer.poll, 1)[0].ok
    reader.submit_load(1, [("ab01", 2)])
    assert collect_results(reader.poll, 1)[0].ok
    assert torch.equal(reader.views[0][2], writer.views[0][1])
    # A link where a block file was, and a FIFO: refused, no hang, nothing followed.
    path = writer._path("ab02")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.kvb"
    shutil.copy(path, outside)
    os.unlink(path)
    os.symlink(outside, path)
    fifo = writer._path("ab03")
    os.unlink(fifo)
    os.mkfifo(fifo, 0o600)
    reader.submit_probe(2, ["ab02", "ab03", "ab04"])
    assert collect_results(reader.poll, 1)[0].failed_keys == ("ab02", "ab03", "ab04")
    reader.submit_load(3, [("ab02", 3), ("ab03", 3)])
    assert collect_results(reader.poll, 1)[0].failed_keys == ("ab02", "ab03")
    assert (reader.views[0][3] == 0).all()
    for tier in (writer, reader):
        tier.shutdown()
    os.unlink(outside)


def test_disk_shared_is_validated():
    with pytest.raises(ValueError) as e:
        OffloadConfig.from_extra_config({"disk_shared": True})
    assert str(e.value) == ("kv_connector_extra_config['disk_shared'] is set but "
                            "'disk_path' is not: expected both for a disk tier")
    with pytest.raises(ValueError) as e:
        OffloadConfig.from_extra_config({"disk_path": "/tmp", "disk_bytes_to_use": 1 << 20,
                                         "disk_shared": "yes"})
    assert str(e.value) == "kv_connector_extra_config['disk_shared']='yes': expected true or false"
