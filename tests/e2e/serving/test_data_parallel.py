"""Data parallel: ``--data-parallel-size 2`` behind vLLM's OpenAI server, with the connector.

Each data-parallel rank is an engine of its own, with its own CPU tier; both
ranks use one ``mooncake_master``. Requests go to a chosen rank with vLLM's
``X-data-parallel-rank`` header, as a router sends them. A server without the
connector, also with two ranks, gives the reference tokens.

* Each rank serves a prompt again from its own CPU tier once its device forgot
  it: token-identical, counted on that rank (``engine`` label), not read from
  the store.
* A prompt served by one rank is a hit on the other through the Mooncake tier:
  the first rank writes its blocks, the other reads them back (its own counters
  say so), token-identical, in both directions.
"""

import pytest

from support.mooncake_master import MooncakeMaster, skip_reason
from support.mooncake_server import PROMPT_BLOCKS, Probe, start_server
from support.openai_server import BLOCK_SIZE, Server


def _old_vllm() -> bool:
    import vllm

    return tuple(int(x) for x in vllm.__version__.split(".")[:2]) < (0, 32)


pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
              pytest.mark.skipif(_old_vllm(), reason="data parallel behind the OpenAI "
                                 "server is run on vLLM 0.32 only (not started on 0.23)")]

HIT = PROMPT_BLOCKS * BLOCK_SIZE
DATA_PARALLEL = ("--data-parallel-size", "2")
# One core per rank (vLLM's CPU workers bind their OpenMP threads), and one block
# hash seed for every process, so both ranks name a block alike.
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "PYTHONHASHSEED": "0"}


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data-parallel")
    with MooncakeMaster(str(tmp / "master.log")) as master:
        plain = Server(tiny_model_dir, tmp / "plain.log", num_gpu_blocks=40, offload=False,
                       extra_args=list(DATA_PARALLEL), env=ENV)
        offload = None
        try:
            offload = start_server(tiny_model_dir, master.address, tmp / "offload.log",
                                   DATA_PARALLEL, ENV)
            plain.wait_ready()
            yield Probe(offload), Probe(plain)
        finally:
            plain.kill()
            if offload is not None:
                offload.kill()


def grown(before: dict, key: str, by: int):
    return lambda now: now.get(key, 0) >= before.get(key, 0) + by


def test_each_rank_serves_a_prompt_again_from_its_own_cpu_tier(servers):
    offload, plain = servers
    for rank in (0, 1):
        seed = 100 + rank
        before = offload.counters(rank)
        text, cached = offload.complete(seed, rank)
        assert cached == 0
        offload.reset_device_cache()  # every rank's device cache; the CPU tiers stay
        assert offload.complete(seed, rank) == (text, HIT)
        assert plain.complete(seed, rank)[0] == text
        after = offload.settled(grown(before, "blocks_loaded", PROMPT_BLOCKS), engine=rank)
        assert after["blocks_loaded"] - before.get("blocks_loaded", 0) == PROMPT_BLOCKS
        assert after["cpu_hit_tokens"] - before.get("cpu_hit_tokens", 0) == HIT
        # Served from the rank's own CPU tier: nothing read from the store.
        assert after.get("blocks_from_mooncake", 0) == before.get("blocks_from_mooncake", 0)


@pytest.mark.parametrize("writer,reader", [(0, 1), (1, 0)])
def test_a_prompt_served_by_one_rank_is_a_hit_on_the_other_through_mooncake(
        servers, writer, reader):
    offload, plain = servers
    seed = 200 + writer
    wrote, read = offload.counters(writer), offload.counters(reader)
    text, cached = offload.complete(seed, writer)
    assert cached == 0
    written = offload.settled(grown(wrote, "blocks_to_mooncake", PROMPT_BLOCKS), engine=writer)
    assert written["blocks_to_mooncake"] - wrote.get("blocks_to_mooncake", 0) == PROMPT_BLOCKS
    # The other rank never computed this prompt: its hit is the blocks the writer stored.
    assert offload.complete(seed, reader) == (text, HIT)
    after = offload.settled(grown(read, "blocks_from_mooncake", PROMPT_BLOCKS), engine=reader)
    assert after["blocks_from_mooncake"] - read.get("blocks_from_mooncake", 0) == PROMPT_BLOCKS
    assert after["cpu_hit_tokens"] - read.get("cpu_hit_tokens", 0) == HIT
    assert plain.complete(seed, reader)[0] == text
