"""Faults of the Mooncake client's batch calls: a call that raises fails its keys.

First the worker half alone, against a client whose batch calls raise (no
master needed): the keys come back failed and no host block changes. Then
whole engines against a real ``mooncake_master`` with one batch call of one
engine's client made to raise: the blocks are recomputed, the tokens are
right, and the counters say what happened.
"""

import pytest
import torch

from support.mooncake_master import MooncakeMaster, skip_reason
from support.polling import collect_results

BS = 16
NUM_BLOCKS = 4
REGION_BYTES = (512, 256)
BATCH_CALLS = ("batch_put_from_multi_buffers", "batch_get_into_multi_buffers",
               "batch_is_exist")


class _RaisingClient:
    """The client surface MooncakeTier uses; the batch calls raise."""

    def __init__(self, raising: str) -> None:
        self.raising = raising
        self.calls: list[str] = []

    def register_buffer(self, ptr, num_bytes):
        return 0

    def unregister_buffer(self, ptr):
        return 0

    def close(self):
        pass

    def remove(self, key, force):
        self.calls.append("remove")

    def __getattr__(self, name):
        if name not in BATCH_CALLS:
            raise AttributeError(name)

        def call(keys, *buffers):
            self.calls.append(name)
            if name == self.raising:
                raise RuntimeError(f"{name}: the transfer engine lost its connection")
            return [0 if name != "batch_is_exist" else 1] * len(keys)

        return call


def _host():
    gen = torch.Generator().manual_seed(0)
    chunk = torch.randint(0, 256, (NUM_BLOCKS * sum(REGION_BYTES),), generator=gen,
                          dtype=torch.uint8)
    k_bytes = NUM_BLOCKS * REGION_BYTES[0]
    views = [chunk[:k_bytes].view(NUM_BLOCKS, -1), chunk[k_bytes:].view(NUM_BLOCKS, -1)]
    return [chunk], views


@pytest.mark.parametrize("call", BATCH_CALLS)
def test_a_batch_call_that_raises_fails_every_key_and_changes_no_host_block(call):
    from kvoffload_hal.tiers.mooncake.worker import MooncakeTier

    chunks, views = _host()
    before = chunks[0].clone()
    tier = MooncakeTier(_RaisingClient(call), chunks, views, bytes(32))
    items = [("k0", 0), ("k1", 2), ("k2", 3)]
    submit = {"batch_put_from_multi_buffers": tier.submit_store,
              "batch_get_into_multi_buffers": tier.submit_load}.get(call)
    if submit is None:
        tier.submit_probe(1, [k for k, _ in items])
    else:
        submit(1, items)
    (result,) = collect_results(tier.poll, 1)
    assert result.job_id == 1 and result.failed_keys == ("k0", "k1", "k2")
    assert torch.equal(chunks[0], before)
    assert tier.client.calls == [call]  # nothing removed: no value was judged bad
    assert tier.shutdown(1.0)


# --------------------------------------------------------- inside engines
PROMPT = [(i * 5) % 83 + 1 for i in range(4 * BS + 1)]


@pytest.fixture
def master(tmp_path):
    """Requested before ``make_engine``, so it stops after the engines: a client
    closing against a stopped master retries its unmount for ~10 s."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    with MooncakeMaster(str(tmp_path / "master.log")) as m:
        yield m


def _engine(make_engine, address):
    return make_engine(cpu_blocks=32, extra_config={
        "mooncake_master": address, "mooncake_segment_bytes": 16 << 20,
        "mooncake_buffer_bytes": 16 << 20, "mooncake_timeout_s": 2.0,
        "mooncake_connect_timeout_s": 1.0})


def _serve(engine, req_id):
    engine.add(req_id, PROMPT)
    engine.run_until_done(max_steps=2000)
    engine.drain()


class _Faulty:
    """The real client, but ``call`` raises (the client's own attributes are read-only)."""

    def __init__(self, client, call):
        self._client, self._call = client, call

    def __getattr__(self, name):
        if name != self._call:
            return getattr(self._client, name)

        def raising(*args, **kwargs):
            raise RuntimeError(f"{name}: injected fault")

        return raising


def _make_raise(engine, call):
    tier = engine.worker.worker.tiers.nearest
    tier.client = _Faulty(tier.client, call)


@pytest.mark.parametrize("call", BATCH_CALLS)
def test_an_engine_whose_batch_call_raises_recomputes_with_the_right_tokens(
        master, make_engine, call):
    writer, reader = _engine(make_engine, master.address), _engine(make_engine, master.address)
    if call == "batch_put_from_multi_buffers":
        _make_raise(writer, call)
    _serve(writer, "w")
    wrote = writer.offload.totals.data
    if call == "batch_put_from_multi_buffers":  # nothing reached the store
        assert wrote.get("blocks_to_mooncake", 0) == 0
        assert wrote["mooncake_failed_blocks"] == 4
    else:
        assert wrote["blocks_to_mooncake"] == 4
        _make_raise(reader, call)
    _serve(reader, "r")
    assert reader.outputs["r"] == writer.outputs["w"]
    read = reader.offload.totals.data
    assert read.get("blocks_from_mooncake", 0) == 0 and read.get("cpu_hit_tokens", 0) == 0
    if call == "batch_get_into_multi_buffers":  # found, then failed to read
        assert read["mooncake_failed_blocks"] >= 1
    writer.assert_idle()
    reader.assert_idle()
