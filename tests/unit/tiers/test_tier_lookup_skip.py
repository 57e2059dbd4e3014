"""A lookup plans a tier hit only where a tier may hold the block after the CPU hit
(``TierChain.may_extend``): a prompt no tier holds costs no walk of vLLM's lookup over
the tiers, and one the disk tier holds still comes back from it. Every KV read is
checked by the harness's model."""

import pytest

BS = 16
PAGE = BS * 128  # one harness block: 16 tokens x 128 bytes of K and V


def _prompt(seed, blocks):
    return [(seed * 7 + i) % 89 + 1 for i in range(blocks * BS + 1)]


def _serve(engine, req_id, prompt):
    engine.add(req_id, prompt)
    engine.run_until_done()
    engine.drain()


@pytest.mark.parametrize("sliding_window", [None, 32], ids=["full", "sliding-window"])
def test_only_a_block_a_tier_holds_is_planned(make_engine, tmp_path, sliding_window):
    engine = make_engine(cpu_blocks=24, num_gpu_blocks=40, sliding_window=sliding_window,
                         extra_config={"disk_path": str(tmp_path / "kv"),
                                       "disk_bytes_to_use": 512 * PAGE})
    walks = []
    find_hit_with = engine.offload.cpu.find_hit_with

    def counted(*args, **kwargs):
        walks.append(args[1])
        return find_hit_with(*args, **kwargs)

    engine.offload.cpu.find_hit_with = counted
    doc = _prompt(1, 8)
    _serve(engine, "a", doc)
    for i in range(2, 6):  # evict "a" from the device and the CPU tier
        _serve(engine, f"x{i}", _prompt(i, 8))
    walks.clear()
    _serve(engine, "new", _prompt(40, 8))
    assert walks == []  # no tier holds any of its blocks: nothing planned
    _serve(engine, "a-again", doc)
    assert walks  # the disk tier holds its blocks: planned
    totals = engine.offload.totals.data
    assert totals["blocks_from_disk"] > 0
    assert engine.cached_tokens["a-again"] == 8 * BS
    assert engine.outputs["a-again"] == engine.outputs["a"]
    engine.assert_idle()
