"""A real ``mooncake_master`` that dies, freezes or goes quiet under a running server.

One server (vLLM's OpenAI server, engine core in its own process) and one
master run for the module; each test starts and ends with the master up.

* The master is killed and a new one started on the same port: while it is
  down, requests are served with their cold tokens; once it is back, the same
  engine writes to it again and reads a prompt back from it.
* The master is frozen (SIGSTOP) for longer than ``-client_ttl``, then the
  engine core is: the master expires the engine's client and unmounts its
  segment. Tokens are right throughout, and the tier comes back by itself.
* With no requests, the server's processes use almost no CPU, with the master
  up and with it frozen after some traffic.
"""

import os
import signal
import time

import pytest

from support.mooncake_master import MooncakeMaster, skip_reason
from support.mooncake_server import PROMPT_BLOCKS, Probe, idle_cores, start_server
from support.openai_server import BLOCK_SIZE, session_members

pytestmark = [pytest.mark.e2e, pytest.mark.two_cores,
              pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))]

CLIENT_TTL_S = 2  # the master's -client_ttl: a freeze of a few seconds outlives it
RECOVER_S = 90  # the breaker's window doubles while the store is away (1 s to 60 s)
IDLE_S = 10
# vLLM's engine core keeps polling for about 1 s after its last request (a server
# without any KV connector does too): the idle measurement starts after it.
SETTLE_S = 3
MAX_IDLE_CORES = 0.05
HIT = PROMPT_BLOCKS * BLOCK_SIZE


@pytest.fixture(scope="module")
def rig(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mooncake-faults")
    with MooncakeMaster(str(tmp / "master.log"), flags=(f"-client_ttl={CLIENT_TTL_S}",)) as m:
        server = start_server(tiny_model_dir, m.address, tmp / "server.log")
        try:
            yield m, Probe(server)
        finally:
            m.thaw()
            server.kill()


def cold_run(probe: Probe, seeds) -> dict[int, str]:
    """First requests for new prompts: nothing cached anywhere, the reference tokens."""
    texts = {}
    for seed in seeds:
        texts[seed], cached = probe.complete(seed)
        assert cached == 0, seed
    return texts


def recovered(probe: Probe, cold: dict[int, str], first_seed: int) -> dict[str, float]:
    """Serve new prompts until one of them is written to the store and read back
    from it (the breaker may wait out its window first); the counters then."""
    deadline = time.monotonic() + RECOVER_S
    seed = first_seed
    while True:
        before = probe.counters()
        cold.update(cold_run(probe, [seed]))
        written = probe.settled(lambda v: v.get("blocks_to_mooncake", 0)
                                >= before.get("blocks_to_mooncake", 0) + PROMPT_BLOCKS, 5)
        if written.get("blocks_to_mooncake", 0) >= before.get("blocks_to_mooncake", 0) \
                + PROMPT_BLOCKS:
            break
        assert time.monotonic() < deadline, f"no write reached the store: {written}"
        seed += 10
    cold.update(cold_run(probe, range(seed + 1, seed + 4)))  # out of the CPU tier
    probe.reset_device_cache()
    text, cached = probe.complete(seed)
    assert text == cold[seed]
    after = probe.settled(lambda v: v.get("blocks_from_mooncake", 0)
                          >= written.get("blocks_from_mooncake", 0) + PROMPT_BLOCKS)
    assert cached == HIT, (cached, after)
    # What the CPU tier lost came from the store (all five blocks in our runs; a
    # block still in the CPU tier would be loaded from there).
    read = after["blocks_from_mooncake"] - written.get("blocks_from_mooncake", 0)
    assert 1 <= read <= PROMPT_BLOCKS, (read, after)
    return after


def test_a_master_restarted_on_the_same_port_is_used_again_without_an_engine_restart(rig):
    master, probe = rig
    seeds = range(1000, 1003)
    cold = cold_run(probe, seeds)
    stored = probe.settled(lambda v: v.get("blocks_to_mooncake", 0) >= 3 * PROMPT_BLOCKS)
    assert stored["blocks_to_mooncake"] >= 3 * PROMPT_BLOCKS

    master.kill()
    cold.update(cold_run(probe, range(1003, 1006)))  # out of the CPU tier
    probe.reset_device_cache()  # and the device: the first prompts are asked of the store
    for seed in seeds:
        assert probe.complete(seed)[0] == cold[seed], seed
    down = probe.counters()
    assert down.get("blocks_from_mooncake", 0) == stored.get("blocks_from_mooncake", 0)

    master.start()  # same port, empty
    after = recovered(probe, cold, 1100)
    assert after["blocks_to_mooncake"] > down.get("blocks_to_mooncake", 0)


def freeze_engine(server_pid: int, seconds: float) -> None:
    """SIGSTOP every process of the server's session for ``seconds``."""
    members = session_members(server_pid)
    for pid in members:
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        for pid in members:
            os.kill(pid, signal.SIGCONT)


def test_freezes_longer_than_the_client_ttl_heal_by_themselves(rig):
    master, probe = rig
    start = probe.counters()
    cold = cold_run(probe, range(2000, 2003))
    probe.settled(lambda v: v["blocks_to_mooncake"] >= start["blocks_to_mooncake"]
                  + 3 * PROMPT_BLOCKS)

    master.freeze()
    try:
        time.sleep(2 * CLIENT_TTL_S + 1)
        cold.update(cold_run(probe, [2003]))  # served while frozen: a timeout, no wait after
    finally:
        master.thaw()
    recovered(probe, cold, 2100)

    logged = os.path.getsize(master.log_path)
    freeze_engine(probe.server.proc.pid, 2 * CLIENT_TTL_S + 1)  # the master expires the client
    with open(master.log_path) as log:
        log.seek(logged)
        assert "action=client_expired" in log.read()
    before = probe.counters()
    for seed in range(2000, 2003):  # in the store before, gone with the segment
        assert probe.complete(seed)[0] == cold[seed], seed
    failed = probe.settled(lambda v: v["mooncake_failed_blocks"] > before["mooncake_failed_blocks"])
    assert failed["blocks_from_mooncake"] == before["blocks_from_mooncake"]
    assert failed["mooncake_failed_blocks"] > before["mooncake_failed_blocks"]
    recovered(probe, cold, 2200)


def test_an_idle_server_uses_almost_no_cpu_with_the_master_up_or_frozen(rig):
    master, probe = rig
    sid = probe.server.proc.pid
    cold = cold_run(probe, range(3000, 3003))
    time.sleep(SETTLE_S)
    up = idle_cores(sid, IDLE_S)

    master.freeze()
    try:
        for seed in range(3003, 3006):  # one waits out the timeout; the breaker opens
            cold.update(cold_run(probe, [seed]))
        time.sleep(SETTLE_S)
        frozen = idle_cores(sid, IDLE_S)
    finally:
        master.thaw()
    print(f"idle cores: master up {up:.4f}, master frozen {frozen:.4f}")
    assert up < MAX_IDLE_CORES and frozen < MAX_IDLE_CORES, (up, frozen)
    for seed in range(3000, 3003):
        assert probe.complete(seed)[0] == cold[seed], seed
