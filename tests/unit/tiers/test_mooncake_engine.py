"""The Mooncake tier inside running engines: vLLM's scheduler, both connector roles, a real
``mooncake_master``. Every KV read is checked by the harness's fake model."""

import time

import pytest

from support.mooncake_master import MooncakeMaster, free_port, skip_reason

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))

BS = 16


def _engine(make_engine, address, sliding_window=None, cpu_blocks=32, num_gpu_blocks=20,
            **extra):
    return make_engine(cpu_blocks=cpu_blocks, num_gpu_blocks=num_gpu_blocks,
                       sliding_window=sliding_window, extra_config={
        "mooncake_master": address, "mooncake_segment_bytes": 16 << 20,
        "mooncake_buffer_bytes": 16 << 20, "mooncake_timeout_s": 2.0,
        "mooncake_connect_timeout_s": 1.0, **extra})


def _serve(engine, req_id, prompt):
    req = engine.add(req_id, prompt)
    engine.run_until_done(max_steps=2000)
    engine.drain()
    return req


PROMPT = [(i * 7) % 89 + 1 for i in range(6 * BS + 1)]


@pytest.fixture
def master(tmp_path, monkeypatch):
    """Requested before ``make_engine``, so it stops after the engines: a client
    closing against a stopped master retries its unmount for ~10 s."""
    # Engines that share the store must name blocks alike: one block-hash seed for all
    # (vLLM 0.23 draws a random one per engine otherwise).
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    with MooncakeMaster(str(tmp_path / "master.log")) as m:
        yield m


def test_a_second_engine_serves_what_the_first_stored(master, make_engine):
    a, b = _engine(make_engine, master.address), _engine(make_engine, master.address)
    _serve(a, "a", PROMPT)
    assert a.offload.totals.data["blocks_to_mooncake"] == 6
    _serve(b, "b", PROMPT)
    assert b.outputs["b"] == a.outputs["a"]
    assert b.offload.totals.data["blocks_from_mooncake"] == 6
    assert b.offload.totals.data["cpu_hit_tokens"] == 6 * BS
    b.assert_idle()


def test_a_model_with_a_sliding_window_group_is_shared_too(master, make_engine):
    """Two KV cache groups: one object per (group, block); the second engine probes
    and promotes both groups' blocks, checked by the fake model."""
    a = _engine(make_engine, master.address, sliding_window=32)
    b = _engine(make_engine, master.address, sliding_window=32)
    _serve(a, "a", PROMPT)
    assert a.offload.caps.tiers == ("mooncake",)
    assert a.offload.totals.data["blocks_to_mooncake"] == 2 * 6
    _serve(b, "b", PROMPT)
    assert b.outputs["b"] == a.outputs["a"]
    assert b.offload.totals.data["blocks_from_mooncake"] > 6  # attention and window blocks
    assert b.offload.totals.data["cpu_hit_tokens"] == 6 * BS
    b.assert_idle()


def test_corrupted_values_are_recomputed_by_the_reader(master, make_engine):
    a, b = _engine(make_engine, master.address), _engine(make_engine, master.address)
    req = _serve(a, "a", PROMPT)
    tier = a.worker.worker.tiers.nearest
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    for block_hash in req.block_hashes[:6]:
        store_key = tier.store_key(make_block_hash_with_group_id(block_hash, 0).hex())
        value = bytearray(tier.client.get(store_key))
        value[-1] ^= 0x5A
        while tier.client.is_exist(store_key) == 1:
            tier.client.remove(store_key, True)
            time.sleep(0.05)
        assert tier.client.put(store_key, bytes(value)) == 0
    _serve(b, "b", PROMPT)
    assert b.outputs["b"] == a.outputs["a"]
    totals = b.offload.totals.data
    assert totals.get("blocks_from_mooncake", 0) == 0 and totals["mooncake_failed_blocks"] >= 1


def test_an_unreachable_master_serves_without_the_tier_or_refuses(make_engine, caplog):
    from kvoffload_hal.tiers.mooncake.client import MooncakeUnavailable

    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    engine = _engine(make_engine, address)
    assert time.monotonic() - started < 30
    _serve(engine, "a", PROMPT)
    assert "blocks_to_mooncake" not in engine.offload.totals.data
    lines = [r for r in caplog.records if f"master {address} unreachable" in r.getMessage()]
    assert len(lines) == 1  # one line, though the scheduler and the worker both checked
    with pytest.raises(MooncakeUnavailable, match="mooncake_required"):
        _engine(make_engine, address, mooncake_required=True)


def test_copies_dropped_for_the_device_are_still_written_through_once(master, make_engine):
    """``device_copies: drop`` on a CPU tier smaller than the device, two KV cache
    groups, prefill in chunks of 2 blocks (so copies of a running request drop): every
    (group, block) reaches the store once, and a second engine serves
    every document from it."""
    docs = [[(i * 7 + d) % 89 + 1 for i in range(4 * BS + 1)] for d in range(6)]
    a = make_engine(cpu_blocks=12, num_gpu_blocks=40, sliding_window=32,
                    max_num_batched_tokens=2 * BS, extra_config={
        "mooncake_master": master.address, "mooncake_segment_bytes": 16 << 20,
        "mooncake_buffer_bytes": 16 << 20, "mooncake_timeout_s": 2.0,
        "mooncake_connect_timeout_s": 1.0, "device_copies": "drop"})
    for i, d in enumerate(docs):
        _serve(a, f"a{i}", d)
    assert a.offload.totals.data["blocks_to_mooncake"] == 2 * 6 * 4
    assert a.offload.cpu.device_copies.num_dropped > 0
    a.assert_idle()
    b = _engine(make_engine, master.address, sliding_window=32)
    for i, d in enumerate(docs):
        _serve(b, f"b{i}", d)
        assert b.outputs[f"b{i}"] == a.outputs[f"a{i}"]
        assert b.cached_tokens[f"b{i}"] == 4 * BS
    b.assert_idle()


DOC = [(i * 5) % 89 + 1 for i in range(20 * BS + 1)]  # 20 blocks


def test_a_hit_longer_than_the_readers_cpu_tier_is_staged_whole(master, make_engine):
    """The reader's CPU tier holds 6 blocks: the 20-block hit it probed comes back in
    rounds through it, every block read from the store."""
    a = _engine(make_engine, master.address, num_gpu_blocks=32)
    _serve(a, "a", DOC)
    b = _engine(make_engine, master.address, cpu_blocks=6, num_gpu_blocks=32)
    _serve(b, "b", DOC)
    assert b.outputs["b"] == a.outputs["a"]
    assert b.cached_tokens["b"] == 20 * BS
    totals = b.offload.totals.data
    assert totals["staged_hits"] == 1 and totals["blocks_from_mooncake"] == 20
    b.assert_idle()


def test_a_block_gone_between_the_query_and_the_read_ends_the_staged_hit_there(
        master, make_engine):
    """Removed from the store once the reader's existence query found it, before its
    read: the read fails, and the hit ends at that block (the rest recomputed)."""
    a = _engine(make_engine, master.address, num_gpu_blocks=32)
    req = _serve(a, "a", DOC)
    b = _engine(make_engine, master.address, cpu_blocks=6, num_gpu_blocks=32)
    b.add("b", DOC)
    for _ in range(200):  # until the hit is staged: the query found every block
        b.step()
        if "b" in b.offload.staged._active:
            break
    assert "b" in b.offload.staged._active
    from support.shared_tier import tier_keys

    gone = a.worker.worker.tiers.nearest.store_key(tier_keys(req, 12)[11])
    while a.worker.worker.tiers.nearest.client.is_exist(gone) == 1:
        a.worker.worker.tiers.nearest.client.remove(gone, True)
        time.sleep(0.05)
    b.run_until_done(max_steps=2000)
    b.drain()
    assert b.outputs["b"] == a.outputs["a"]
    assert b.cached_tokens["b"] == 11 * BS  # up to the vanished block, no further
    totals = b.offload.totals.data
    assert totals.get("staged_hits", 0) == 0 and totals["mooncake_failed_blocks"] >= 1
    assert totals["blocks_from_mooncake"] == 11
    b.assert_idle()
