"""MooncakeTier against a real ``mooncake_master`` and real clients (TCP on loopback)."""

import time

import numpy as np
import pytest
import torch

from support.mooncake_master import MooncakeMaster, skip_reason

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))

NUM_BLOCKS = 8
REGION_BYTES = (4096, 1536)  # two host regions per block, as K and V
FP_A, FP_B = bytes(range(32)), bytes(range(1, 33))


def _cfg(address, **kw):
    from kvoffload_hal.tiers.mooncake.config import MooncakeConfig

    return MooncakeConfig(master=address, segment_bytes=16 << 20, buffer_bytes=16 << 20,
                          connect_timeout_s=2.0, **kw)


class Host:
    """A CPU tier's host memory in two buffers (as the NPU backend allocates a large
    tier: regions never split), and its per-region block views."""

    def __init__(self, seed=0):
        gen = torch.Generator().manual_seed(seed)
        split = len(REGION_BYTES) // 2 or 1
        self.chunks, self.views = [], []
        for sizes in (REGION_BYTES[:split], REGION_BYTES[split:]):
            chunk = torch.randint(0, 256, (NUM_BLOCKS * sum(sizes),), generator=gen,
                                  dtype=torch.uint8)
            offset = 0
            for n in sizes:
                self.views.append(chunk[offset:offset + NUM_BLOCKS * n].view(NUM_BLOCKS, n))
                offset += NUM_BLOCKS * n
            self.chunks.append(chunk)

    def block(self, b):
        return b"".join(v[b].numpy().tobytes() for v in self.views)


def _tier(address, host, fingerprint=FP_A):
    from kvoffload_hal.tiers.mooncake.worker import open_mooncake_tier

    return open_mooncake_tier(_cfg(address), host.chunks, host.views, fingerprint)


def _wait(tier, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    results = []
    while time.monotonic() < deadline:
        results += tier.poll()
        if not tier.num_pending:
            return {r.job_id: r for r in results}
        time.sleep(0.01)
    raise AssertionError("Mooncake tier jobs did not finish")


@pytest.fixture
def master(tmp_path):
    with MooncakeMaster(str(tmp_path / "master.log")) as m:
        yield m


@pytest.fixture
def tiers(master):
    made = []

    def make(host, fingerprint=FP_A):
        made.append(_tier(master.address, host, fingerprint))
        return made[-1]

    yield make
    for t in made:
        t.shutdown(5.0)


def test_blocks_written_by_one_instance_are_read_byte_exact_by_another(tiers):
    a_host, b_host = Host(seed=1), Host(seed=2)
    a, b = tiers(a_host), tiers(b_host)
    a.submit_store(1, [("k0", 0), ("k1", 3)])
    assert _wait(a)[1].ok
    b.submit_probe(2, ["k0", "k1", "k2"])
    assert _wait(b)[2].failed_keys == ("k2",)
    b.submit_load(3, [("k0", 5), ("k1", 6)])
    assert _wait(b)[3].ok
    assert b_host.block(5) == a_host.block(0) and b_host.block(6) == a_host.block(3)


def test_another_fingerprint_never_sees_the_blocks(tiers):
    a_host, c_host = Host(seed=1), Host(seed=3)
    a, c = tiers(a_host), tiers(c_host, fingerprint=FP_B)
    a.submit_store(1, [("k0", 0)])
    assert _wait(a)[1].ok
    before = c_host.block(2)
    c.submit_probe(2, ["k0"])
    c.submit_load(3, [("k0", 2)])
    results = _wait(c)
    assert results[2].failed_keys == ("k0",) and results[3].failed_keys == ("k0",)
    assert c_host.block(2) == before


def _put_raw(tier, key, value: bytes):
    """Write ``value`` under the tier's store key through the real client."""
    store_key = tier.store_key(key)
    deadline = time.monotonic() + 10
    while tier.client.is_exist(store_key) == 1 and time.monotonic() < deadline:
        tier.client.remove(store_key, True)
        time.sleep(0.1)
    assert tier.client.put(store_key, value) == 0


@pytest.mark.parametrize("damage", ["payload", "truncated", "key"])
def test_a_damaged_value_fails_its_key_and_is_removed(tiers, damage):
    from kvoffload_hal.tiers.mooncake.worker import HEADER

    host = Host(seed=4)
    tier = tiers(host)
    tier.submit_store(1, [("k0", 0)])
    assert _wait(tier)[1].ok
    value = bytearray(tier.client.get(tier.store_key("k0")))
    if damage == "payload":
        value[-7] ^= 0xFF  # one flipped bit pattern deep in the block
    elif damage == "truncated":
        value = value[:len(value) // 2]  # half-written
    else:
        value[HEADER.size] = ord("x")  # the key it names
    _put_raw(tier, "k0", bytes(value))
    tier.submit_load(2, [("k0", 4)])
    assert _wait(tier)[2].failed_keys == ("k0",)
    if damage != "truncated":  # a value of the right size that fails its check is removed
        assert tier.client.is_exist(tier.store_key("k0")) != 1


def test_a_killed_master_fails_jobs_at_once_and_poll_never_blocks(master, tiers):
    host = Host(seed=5)
    tier = tiers(host)
    tier.submit_store(1, [("k0", 0)])
    assert _wait(tier)[1].ok
    master.kill()
    before = host.block(1)
    started = time.monotonic()
    tier.submit_store(2, [("k1", 2)])
    tier.submit_load(3, [("k0", 1)])
    tier.submit_probe(4, ["k0"])
    poll_started = time.monotonic()
    early = {r.job_id: r for r in tier.poll()}
    assert time.monotonic() - poll_started < 0.05  # poll only collects
    results = {**early, **_wait(tier)}
    assert all(results[j].failed_keys for j in (2, 3, 4)), results
    assert time.monotonic() - started < 10
    assert host.block(1) == before  # nothing read wrong


def test_an_unreachable_master_gives_a_tier_that_fails_every_job(caplog):
    from kvoffload_hal.tiers.mooncake.client import MooncakeUnavailable
    from kvoffload_hal.tiers.mooncake.worker import UnavailableTier, open_mooncake_tier
    from support.mooncake_master import free_port

    host = Host()
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    tier = open_mooncake_tier(_cfg(address), host.chunks, host.views, FP_A)
    assert isinstance(tier, UnavailableTier) and time.monotonic() - started < 5
    tier.submit_load(1, [("k0", 0)])
    tier.submit_probe(2, ["k0"])
    assert {r.job_id: r.failed_keys for r in tier.poll()} == {1: ("k0",), 2: ("k0",)}
    with pytest.raises(MooncakeUnavailable, match=f"master {address} unreachable.*required"):
        open_mooncake_tier(_cfg(address, required=True), host.chunks, host.views, FP_A)


def test_store_keys_name_the_fingerprint(tiers):
    tier = tiers(Host())
    assert tier.store_key("ab") == f"kvhal/{FP_A.hex()}/ab"
    assert np.frombuffer(FP_A, dtype=np.uint8).size == 32


def test_a_peer_that_left_fails_its_blocks_and_nothing_is_read_wrong(master):
    """The bytes live in the writer's segment: once it is gone, reads fail cleanly."""
    from kvoffload_hal.tiers.mooncake.worker import open_mooncake_tier

    a_host, b_host = Host(seed=6), Host(seed=7)
    a = _tier(master.address, a_host)
    b = open_mooncake_tier(_cfg(master.address).__class__(
        master=master.address, segment_bytes=0, buffer_bytes=16 << 20, connect_timeout_s=2.0),
        b_host.chunks, b_host.views, FP_A)  # contributes no memory: every object is a's
    try:
        a.submit_store(1, [("k0", 0), ("k1", 1)])
        assert _wait(a)[1].ok
        b.submit_load(2, [("k0", 2)])
        assert _wait(b)[2].ok and b_host.block(2) == a_host.block(0)
        assert a.shutdown(5.0)  # the peer leaves, its segment with it
        b.submit_load(3, [("k1", 3)])  # a failed key: the block is never published
        assert _wait(b, timeout_s=60)[3].failed_keys == ("k1",)
    finally:
        b.shutdown(5.0)


def test_the_smallest_segment_the_config_accepts_is_the_clients_own_minimum(master):
    from mooncake.store import MooncakeDistributedStore

    from kvoffload_hal.tiers.mooncake.config import MIN_SEGMENT_BYTES

    codes = {}
    for size in (MIN_SEGMENT_BYTES - 1, MIN_SEGMENT_BYTES):
        client = MooncakeDistributedStore()
        codes[size] = client.setup("127.0.0.1", "P2PHANDSHAKE", size, 16 << 20, "tcp", "",
                                   master.address)
        if codes[size] == 0:
            client.close()
    assert codes[MIN_SEGMENT_BYTES] == 0 and codes[MIN_SEGMENT_BYTES - 1] != 0, codes


def test_a_test_masters_rpc_and_metrics_ports_differ():
    """The ports of a test's master are held together while chosen: asked for one after
    the other, the system once handed out the same free port twice, and the master
    (metrics on its RPC port) exited right after it started."""
    from support.mooncake_master import MooncakeMaster, free_ports

    assert all(len(set(free_ports(3))) == 3 for _ in range(200))
    master = MooncakeMaster()
    assert master.port != master.metrics_port
