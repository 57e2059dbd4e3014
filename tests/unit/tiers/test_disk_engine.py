"""The disk tier inside a running engine: vLLM's scheduler, both connector roles, real files.

See ``engine_harness.py``: every KV read is checked by the fake model.
"""

import os
import random
import threading

from support.disk_files import flip_a_byte_of_every_block

BS = 16
PAGE = BS * 128  # one harness block: 16 tokens x 128 bytes of K and V


def _disk_engine(make_engine, tmp_path, cpu_blocks, disk_blocks=256, **kwargs):
    return make_engine(cpu_blocks=cpu_blocks, extra_config={
        "disk_path": str(tmp_path / "kv"), "disk_bytes_to_use": disk_blocks * PAGE}, **kwargs)


def _prompt(seed, blocks):
    return [(seed * 7 + i) % 89 + 1 for i in range(blocks * BS + 1)]


def _serve(engine, req_id, prompt, max_steps=400):
    engine.add(req_id, prompt)
    engine.run_until_done(max_steps=max_steps)
    engine.drain()


def test_a_disk_hit_longer_than_the_cpu_tier_finishes(make_engine, tmp_path):
    """A promotion never evicts the hit it serves (a longer one is staged: test_staged_hits)."""
    # Prefill 4 blocks per step: each step's blocks reach the CPU tier, then the disk.
    engine = _disk_engine(make_engine, tmp_path, cpu_blocks=16, num_gpu_blocks=24,
                          max_num_batched_tokens=4 * BS)
    long_doc = _prompt(1, 20)
    _serve(engine, "a", long_doc)
    _serve(engine, "b", _prompt(2, 20))  # evicts "a" from the device and the CPU tier
    _serve(engine, "c", long_doc[:4 * BS + 1])  # a short CPU hit in front of the disk hit
    _serve(engine, "a-again", long_doc)
    assert engine.outputs["a-again"] == engine.outputs["a"]
    totals = engine.offload.totals.data
    assert totals["blocks_from_disk"] > 0 and totals["cpu_hit_tokens"] > 4 * BS
    # The run fits the free CPU blocks only if the hit's own blocks count as free: it is
    # staged, and comes back whole.
    assert engine.cached_tokens["a-again"] == 20 * BS
    engine.assert_idle()


def _docs(n, length, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 90) for _ in range(length)] for _ in range(n)]


def _sequential_passes(engine, docs, passes=2):
    for p in range(passes):
        for i, d in enumerate(docs):
            engine.add(f"{p}-{i}", d + [p])
            engine.run_until_done()
            engine.drain()


def _disk(tmp_path, blocks):
    return {"disk_path": str(tmp_path / "disk"), "disk_bytes_to_use": blocks * PAGE}


def test_prefixes_evicted_from_device_and_cpu_come_back_from_disk(make_engine, tmp_path):
    engine = make_engine(cpu_blocks=12, extra_config=_disk(tmp_path, 200))
    _sequential_passes(engine, _docs(6, 80))  # 30 blocks: the CPU tier holds 12
    totals = engine.offload.totals.data
    assert totals["blocks_to_disk"] == 30
    assert totals["blocks_from_disk"] >= 6 * 5 - 12  # at least what the CPU had to drop
    assert totals["cpu_hit_tokens"] == 6 * 80  # every block came back, checked by the model
    engine.assert_idle()


def test_corrupted_disk_blocks_are_recomputed(make_engine, tmp_path):
    engine = make_engine(cpu_blocks=12, extra_config=_disk(tmp_path, 200))
    docs = _docs(6, 80)
    for i, d in enumerate(docs):
        engine.add(f"a{i}", d)
        engine.run_until_done()
        engine.drain()
    root = engine.worker.worker.tiers.nearest.root
    flip_a_byte_of_every_block(root)
    for i, d in enumerate(docs):
        engine.add(f"b{i}", d + [7])
        engine.run_until_done()
        engine.drain()
    # Nothing came from disk; what the CPU tier still held was used; the rest
    # was recomputed (and the model check saw only correct KV).
    assert engine.offload.totals.data.get("blocks_from_disk", 0) == 0
    assert all(len(engine.outputs[f"b{i}"]) == 4 for i in range(6))
    engine.assert_idle()


def test_small_disk_tier_evicts_lru_and_stays_consistent(make_engine, tmp_path):
    engine = make_engine(cpu_blocks=8, extra_config=_disk(tmp_path, 12))
    _sequential_passes(engine, _docs(6, 80))
    assert len(engine.offload.tiers.nearest.index) <= 12
    files = sum(len(f) for _, _, f in os.walk(engine.worker.worker.tiers.nearest.root))
    assert files <= 12 + 8 + 2  # evicted files are deleted (asynchronously); marker, lock
    engine.assert_idle()


def test_a_model_with_a_sliding_window_group_gets_its_prefixes_back_from_disk(
        make_engine, tmp_path):
    """Two KV cache groups: one file per (group, block); a promotion brings back every
    group's blocks of the run, and the fake model checks each block attention reads."""
    engine = make_engine(sliding_window=32, num_gpu_blocks=40, cpu_blocks=12,
                         extra_config=_disk(tmp_path, 400))
    assert engine.offload.caps.tiers == ("disk",)
    _sequential_passes(engine, _docs(6, 80))  # 30 blocks a group: the CPU tier holds 12
    totals = engine.offload.totals.data
    assert totals["blocks_to_disk"] == 2 * 30  # both groups' blocks written through
    from vllm.v1.core.kv_cache_utils import get_group_id

    keys = engine.offload.tiers.nearest.index._entries
    assert {get_group_id(bytes.fromhex(k)) for k in keys} == {0, 1}
    assert totals["blocks_from_disk"] > 0
    assert totals["cpu_hit_tokens"] >= 6 * 64  # most of each document came back
    engine.assert_idle()


def test_a_disk_hit_waits_while_spills_hold_every_cpu_block(make_engine, tmp_path):
    """A request with a disk hit arrives while spills in flight pin every CPU block (an
    offline engine that stopped stepping when its last request finished, or a busy one):
    it waits for them, then gets its blocks back from disk, instead of recomputing its
    whole prompt and losing the hit for good."""
    # 4 CPU blocks: 3 usable (vLLM's null block takes one).
    engine = _disk_engine(make_engine, tmp_path, cpu_blocks=4, num_gpu_blocks=16)
    doc = _prompt(1, 6)
    _serve(engine, "a", doc)
    for seed in range(2, 5):
        _serve(engine, f"other{seed}", _prompt(seed, 6))  # "a" leaves the device and CPU
    tier = engine.worker.worker.tiers.nearest
    gate = threading.Event()  # disk writes wait here: the spills stay in flight
    write = tier._store_batch
    tier._store_batch = lambda items: (gate.wait(30), write(items))[1]
    try:
        engine.add("last", _prompt(5, 6))
        while "last" not in engine.finished:
            engine.step()
        assert engine.offload.cpu.num_free_blocks() == 0  # all being written to disk
        hits = engine.offload.totals.data.get("cpu_hit_tokens", 0)
        engine.add("a-again", doc)
        for _ in range(3):
            engine.step()
            assert "a-again" not in engine.cached_tokens  # waits: nothing recomputed
    finally:
        gate.set()
    engine.run_until_done()
    engine.drain()
    assert engine.outputs["a-again"] == engine.outputs["a"]
    # Its 6 blocks came back from disk, staged through the 3 CPU blocks.
    assert engine.cached_tokens["a-again"] == 6 * BS
    assert engine.offload.totals.data["cpu_hit_tokens"] - hits == 6 * BS
    engine.assert_idle()
