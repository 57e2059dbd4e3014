"""The disk tier inside a running engine: vLLM's scheduler, both connector roles, real files."""

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
    """A promotion never evicts the hit it serves: what fits is loaded, the rest recomputed."""
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
    engine.assert_idle()

