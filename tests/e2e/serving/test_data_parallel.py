"""Data parallel: ``--data-parallel-size 2`` behind vLLM's OpenAI server, with the connector.

Each data-parallel rank is an engine of its own, with its own CPU tier; the ranks
share blocks through one ``mooncake_master``, or through one disk tier on
``/dev/shm`` (``disk_shared``, no master). Requests go to a chosen rank with vLLM's
``X-data-parallel-rank`` header, as a router sends them. A server without the
connector, also with two ranks, gives the reference tokens.

* Each rank serves a prompt again from its own CPU tier once its device forgot
  it: token-identical, counted on that rank (``engine`` label), not read from
  the store.
* A prompt served by one rank is a hit on the other through the Mooncake tier:
  the first rank writes its blocks, the other reads them back (its own counters
  say so), token-identical, in both directions.
* The same through a disk tier both ranks share on ``/dev/shm``: the reader's
  blocks come from the files the writer wrote (it reads them and writes none).
"""

import json
import shutil
import tempfile

import pytest

from kvoffload_hal.demo.inprocess import CONNECTOR
from support.mooncake_master import MooncakeMaster, skip_reason
from support.mooncake_server import BLOCK_BYTES, CPU_BLOCKS, PROMPT_BLOCKS, Probe, start_server
from support.openai_server import BLOCK_SIZE, Server

# make test runs these on the vLLM 0.32 lane only (data parallel behind the OpenAI
# server is not started on the 0.23 lane).
pytestmark = [pytest.mark.e2e, pytest.mark.two_cores, pytest.mark.main_lane]
needs_mooncake = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))

HIT = PROMPT_BLOCKS * BLOCK_SIZE
DATA_PARALLEL = ("--data-parallel-size", "2")
# One core per rank (vLLM's CPU workers bind their OpenMP threads), and one block
# hash seed for every process, so both ranks name a block alike.
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "PYTHONHASHSEED": "0"}
# Four engine cores on a small CI host answer an existence query slowly; these tests
# are about what the store serves, so a lookup waits long enough not to give up.
STORE_WAIT_S = 30.0


@pytest.fixture(scope="module")
def plain(tiny_model_dir, tmp_path_factory):
    """The reference server, started once for the module; waited for by whoever uses it
    (it starts while the first server with the connector does)."""
    tmp = tmp_path_factory.mktemp("data-parallel")
    server = Server(tiny_model_dir, tmp / "plain.log", num_gpu_blocks=40, offload=False,
                    extra_args=list(DATA_PARALLEL), env=ENV)
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="class")
def servers(tiny_model_dir, tmp_path_factory, plain):
    tmp = tmp_path_factory.mktemp("data-parallel-mooncake")
    # A read lease of 5 s (the support master's 500 ms ran out mid-read in a CI run: four
    # engines on two cores): nothing here removes an object once read.
    with MooncakeMaster(str(tmp / "master.log"), flags=("-default_kv_lease_ttl=5000",)) as master:
        offload = start_server(tiny_model_dir, master.address, tmp / "offload.log",
                               DATA_PARALLEL, ENV, timeout_s=STORE_WAIT_S)
        try:
            plain.wait_ready()
            yield Probe(offload), Probe(plain)
        finally:
            offload.kill()


def grown(before: dict, key: str, by: int):
    return lambda now: now.get(key, 0) >= before.get(key, 0) + by


@needs_mooncake
class TestMooncake:
    """Its server stops before the next one starts: two servers with the connector at
    once would run four engines beside the reference server's two."""

    def test_each_rank_serves_a_prompt_again_from_its_own_cpu_tier(self, servers):
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
            assert after.get("blocks_from_mooncake", 0) == before.get("blocks_from_mooncake",
                                                                        0)

    @pytest.mark.parametrize("writer,reader", [(0, 1), (1, 0)])
    def test_a_prompt_served_by_one_rank_is_a_hit_on_the_other_through_mooncake(
            self, servers, writer, reader):
        offload, plain = servers
        seed = 200 + writer
        wrote, read = offload.counters(writer), offload.counters(reader)
        text, cached = offload.complete(seed, writer)
        assert cached == 0
        written = offload.settled(grown(wrote, "blocks_to_mooncake", PROMPT_BLOCKS),
                                  engine=writer)
        assert (written["blocks_to_mooncake"] - wrote.get("blocks_to_mooncake", 0)
                == PROMPT_BLOCKS)
        # The other rank never computed this prompt: its hit is the blocks the writer stored.
        assert offload.complete(seed, reader) == (text, HIT), offload.counters(reader)
        after = offload.settled(grown(read, "blocks_from_mooncake", PROMPT_BLOCKS),
                                engine=reader)
        assert (after["blocks_from_mooncake"] - read.get("blocks_from_mooncake", 0)
                == PROMPT_BLOCKS)
        assert after["cpu_hit_tokens"] - read.get("cpu_hit_tokens", 0) == HIT
        assert plain.complete(seed, reader)[0] == text


@pytest.fixture(scope="module")
def shm_servers(tiny_model_dir, tmp_path_factory, plain):
    """The server with a disk tier its two ranks share, in a fresh private directory
    under /dev/shm (memory, as a host gives it to the ranks), removed afterwards."""
    tmp = tmp_path_factory.mktemp("data-parallel-shm")
    shm = tempfile.mkdtemp(prefix="kvoffload-dp-", dir="/dev/shm")  # mode 0700
    config = {"kv_connector": CONNECTOR, "kv_role": "kv_both",
              "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {
                  "cpu_bytes_to_use": CPU_BLOCKS * BLOCK_BYTES, "eviction": "lru",
                  "disk_path": f"{shm}/kv", "disk_bytes_to_use": 64 * BLOCK_BYTES,
                  "disk_shared": True, "disk_retention": "remove"}}
    offload = Server(tiny_model_dir, tmp / "offload.log", num_gpu_blocks=40, offload=False,
                     extra_args=["--kv-transfer-config", json.dumps(config), *DATA_PARALLEL],
                     env=ENV)
    try:
        offload.wait_ready()
        plain.wait_ready()
        yield Probe(offload), Probe(plain)
    finally:
        offload.kill()
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.parametrize("writer,reader", [(0, 1), (1, 0)])
def test_a_prompt_served_by_one_rank_is_a_hit_on_the_other_through_a_shared_disk(
        shm_servers, writer, reader):
    offload, plain = shm_servers
    seed = 300 + writer
    wrote, read = offload.counters(writer), offload.counters(reader)
    text, cached = offload.complete(seed, writer)
    assert cached == 0
    written = offload.settled(grown(wrote, "blocks_to_disk", PROMPT_BLOCKS), engine=writer)
    assert written["blocks_to_disk"] - wrote.get("blocks_to_disk", 0) == PROMPT_BLOCKS
    # The other rank never computed this prompt: its hit is the files the writer wrote.
    assert offload.complete(seed, reader) == (text, HIT)
    after = offload.settled(grown(read, "blocks_from_disk", PROMPT_BLOCKS), engine=reader)
    assert after["blocks_from_disk"] - read.get("blocks_from_disk", 0) == PROMPT_BLOCKS
    assert after["cpu_hit_tokens"] - read.get("cpu_hit_tokens", 0) == HIT
    assert after.get("blocks_to_disk", 0) == read.get("blocks_to_disk", 0)  # wrote none
    assert plain.complete(seed, reader)[0] == text
