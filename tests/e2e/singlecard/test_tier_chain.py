"""CPU tier, disk tier and a real Mooncake Store as one chain behind the device.

One engine with a CPU tier of about two documents, a disk tier of about three and a
Mooncake tier that holds them all (``disk_path`` and ``mooncake_master`` together; the
chain's order is the default: the disk first). Every document is served once, then the
device's prefix cache is reset and they are served again, newest first: the newest
comes back from the CPU tier, older ones from disk, and the oldest, gone from the CPU
and disk tiers, from Mooncake. Each repeat is token-identical to its first serving; the
counters say which tier served each one; and the same run with a backend that damages
every load changes the repeats' tokens, so the comparison can fail.
"""

import pytest

from kvoffload_hal.demo.inprocess import EngineSpec, close_llm, make_llm, scheduler_connector
from kvoffload_hal.demo.tiny_model import synthetic_text
from support.mooncake_master import MooncakeMaster, skip_reason

pytestmark = [pytest.mark.e2e, pytest.mark.two_cores,
              pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))]

BLOCK = 32  # EngineSpec's block size
BLOCK_BYTES = 2 * BLOCK * 2 * 128 * 2  # layers x tokens x heads x (K+V)·head_dim x bf16
NUM_DOCS = 8
COUNTERS = ("blocks_from_disk", "blocks_from_mooncake", "blocks_loaded")


def _serve_all_twice(model: str, master: str, disk_path: str, seed: int) -> list[dict]:
    from vllm import SamplingParams

    llm = make_llm(EngineSpec(
        model, num_gpu_blocks=24, offload=True, cpu_bytes_to_use=12 * BLOCK_BYTES,
        extra_config={"disk_path": disk_path, "disk_bytes_to_use": 18 * BLOCK_BYTES,
                      "mooncake_master": master, "mooncake_segment_bytes": 32 << 20,
                      "mooncake_buffer_bytes": 16 << 20, "mooncake_timeout_s": 5.0,
                      "eviction": "lru", "prefetch_requests": 0}))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    docs = [synthetic_text(150, seed=seed + i) for i in range(NUM_DOCS)]
    try:
        offload = scheduler_connector(llm).scheduler
        assert [tier.names.name for tier in offload.tiers] == ["disk", "mooncake"]
        first = [llm.generate([d], params, use_tqdm=False)[0] for d in docs]
        llm.reset_prefix_cache()  # the device's prefix cache only: the tiers keep theirs
        served = []  # newest first: loads of older documents evict the CPU tier's
        for doc, before in reversed(list(zip(docs, first))):
            counts = dict(offload.totals.data)
            again = llm.generate([doc], params, use_tqdm=False)[0]
            served.append({
                "first": list(before.outputs[0].token_ids),
                "again": list(again.outputs[0].token_ids),
                "cached": again.num_cached_tokens,
                "full": (len(again.prompt_token_ids) - 1) // BLOCK * BLOCK,
                **{k: offload.totals.data.get(k, 0) - counts.get(k, 0) for k in COUNTERS}})
        return served
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    with MooncakeMaster(str(tmp_path_factory.mktemp("chain") / "master.log")) as m:
        yield m.address


def test_each_block_comes_back_from_the_nearest_tier_that_holds_it(tiny_model_dir, master,
                                                                    tmp_path):
    served = _serve_all_twice(tiny_model_dir, master, str(tmp_path / "kv"), seed=300)
    for i, s in enumerate(served):
        assert s["again"] == s["first"], i
        assert s["cached"] == s["full"] and s["full"] >= 4 * BLOCK, i
    newest, oldest = served[0], served[-1]
    # The oldest document left the CPU and disk tiers: Mooncake served every block.
    assert oldest["blocks_from_mooncake"] == oldest["full"] // BLOCK
    assert oldest["blocks_from_disk"] == 0
    # The newest is still in the CPU tier: loaded from there, read from no other tier.
    assert newest["blocks_loaded"] == newest["full"] // BLOCK
    assert newest["blocks_from_disk"] == newest["blocks_from_mooncake"] == 0
    # Some document between them came back from the disk tier, not from Mooncake.
    assert any(s["blocks_from_disk"] == s["full"] // BLOCK and not s["blocks_from_mooncake"]
               for s in served[1:-1]), served


def test_canary_damaged_loads_change_the_repeats(tiny_model_dir, master, tmp_path,
                                                 monkeypatch):
    """The comparison above can fail: with every load damaged, repeats differ."""
    from kvoffload_hal.hal import register_backend

    register_backend("corrupting-cpu", "corrupting_backend:CorruptingCpuBackend",
                     synchronous_compute=True)
    monkeypatch.setenv("KVOFFLOAD_HAL_BACKEND", "corrupting-cpu")
    monkeypatch.syspath_prepend(__file__.rsplit("/", 1)[0])
    # Other documents: none of them is in the store yet.
    served = _serve_all_twice(tiny_model_dir, master, str(tmp_path / "kv"), seed=400)
    assert served[-1]["blocks_from_mooncake"] > 0  # the oldest: from Mooncake
    assert sum(s["again"] != s["first"] for s in served) >= NUM_DOCS // 2, served
