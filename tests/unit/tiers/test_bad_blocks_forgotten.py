"""A tier block that failed its read is forgotten: no later request reads it again.

A staged hit's promotion (scheduler/secondary/staged.py) and, on vLLM < 0.32 with several
KV cache groups, the check before the offer (scheduler/secondary/staged_check.py) read tier
blocks through the CPU tier. A read that fails (here: a disk block whose checksum no
longer matches) ends the hit there and drops the block's key from the tier's index. The
request recomputes that block, its spill writes it again, and the next request on the
document is served whole from the disk. Were the key kept, the spill would take the
block as already written and every later request would stop at the bad copy again.

vLLM's real scheduler and both connector roles (``engine_harness.py``): the fake model
checks every KV read.
"""

from support.disk_files import flip_a_byte_of_block
from support.serving_rig import document, serve

BS = 16
PAGE = BS * 128  # one harness block: 16 tokens x 128 bytes of K and V
DOC_BLOCKS = 20


def _doc(seed):
    return document(seed, DOC_BLOCKS)


def _serve(engine, *requests):
    return serve(engine, *requests, max_steps=3000)


def _off_the_device_and_cpu(engine, seed):
    """Two other documents: the last one served leaves the device and the CPU tier."""
    for i in range(2):
        _serve(engine, (f"other-{seed}-{i}", _doc(seed + i)))


def _bad_block_is_read_once(engine, bad):
    doc = _doc(1)
    (first,) = _serve(engine, ("first", doc))
    _off_the_device_and_cpu(engine, 50)
    flip_a_byte_of_block(engine.worker.worker.tiers.nearest.root, first.block_hashes[bad])
    _serve(engine, ("bad", doc))
    assert engine.cached_tokens["bad"] < (bad + 1) * BS  # the hit ended before the bad block
    for n in range(2):  # every later request: the whole document, from the disk
        _off_the_device_and_cpu(engine, 60 + 2 * n)
        before = engine.offload.totals.data.get("blocks_from_disk", 0)
        _serve(engine, (f"later-{n}", doc))
        assert engine.cached_tokens[f"later-{n}"] == DOC_BLOCKS * BS, "the bad block read again"
        assert engine.offload.totals.data["blocks_from_disk"] - before >= DOC_BLOCKS
        assert engine.outputs[f"later-{n}"] == engine.outputs["first"]
    engine.assert_idle()


def test_a_staged_hit_forgets_a_block_that_failed_its_read(make_engine, tmp_path):
    """One KV cache group, a CPU tier of 6 blocks: the 20-block hit is staged."""
    engine = make_engine(cpu_blocks=6, num_gpu_blocks=24, max_num_batched_tokens=4 * BS,
                         extra_config={"disk_path": str(tmp_path / "kv"),
                                       "disk_bytes_to_use": 256 * PAGE})
    _bad_block_is_read_once(engine, bad=DOC_BLOCKS // 2 - 1)


def test_a_hybrid_hit_forgets_a_block_that_failed_its_read(make_engine, tmp_path):
    """Two full-attention and two sliding-window groups: on vLLM >= 0.32 the staged hit
    reads the bad block; on vLLM < 0.32 the check before the offer does."""
    engine = make_engine(cpu_blocks=12, num_gpu_blocks=72, sliding_window=32,
                         full_groups=2, sliding_groups=2, max_num_batched_tokens=2 * BS,
                         extra_config={"disk_path": str(tmp_path / "kv"),
                                       "disk_bytes_to_use": 1024 * PAGE})
    _bad_block_is_read_once(engine, bad=11)
