"""A frozen ``mooncake_master`` (SIGSTOP) under running engines: the circuit breaker.

The first request pays the full ``mooncake_timeout_s``; the breaker opens and
the requests after it do not wait at all. What is asserted is what a user sees
(one full wait, then none, the breaker open once), not which of the scheduler's
two timeout checks ended the wait. After SIGCONT the stuck calls end,
and once the window passed one request probes the store, the breaker closes,
and reads and writes work again.
"""

import os
import signal
import time

import pytest

from support.mooncake_master import MooncakeMaster, skip_reason
from support.polling import wait_until

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))

BS = 16
TIMEOUT_S = 2.0
WINDOW_S = 3.0  # the breaker's first window, longer than the requests served inside it


def _prompt(seed):
    return [(i * 7 + seed * 13) % 89 + 1 for i in range(4 * BS + 1)]


def _engine(make_engine, address):
    return make_engine(cpu_blocks=32, extra_config={
        "mooncake_master": address, "mooncake_segment_bytes": 16 << 20,
        "mooncake_buffer_bytes": 16 << 20, "mooncake_timeout_s": TIMEOUT_S,
        "mooncake_connect_timeout_s": 1.0})


def _serve(engine, req_id, prompt):
    started = time.monotonic()
    engine.add(req_id, prompt)
    engine.run_until_done(max_steps=100_000)
    engine.drain()
    return time.monotonic() - started


@pytest.fixture
def master(tmp_path):
    """Requested before ``make_engine``, so it stops after the engines: a client
    closing against a stopped master retries its unmount for ~10 s."""
    with MooncakeMaster(str(tmp_path / "master.log")) as m:
        yield m
        os.killpg(m.proc.pid, signal.SIGCONT)  # never leave it stopped


def test_a_frozen_master_costs_one_timeout_then_the_tier_comes_back(master, make_engine):
    writer, reader = _engine(make_engine, master.address), _engine(make_engine, master.address)
    for seed in (0, 1):
        _serve(writer, f"w{seed}", _prompt(seed))
    assert writer.offload.totals.data["blocks_to_mooncake"] == 8
    breaker = reader.offload.tiers.nearest.breaker
    breaker.base_backoff_s = WINDOW_S

    os.killpg(master.proc.pid, signal.SIGSTOP)
    first = _serve(reader, "r0", _prompt(0))
    later = [_serve(reader, f"r{seed}", _prompt(seed)) for seed in (2, 3, 4)]
    assert first >= TIMEOUT_S and max(later) < TIMEOUT_S / 2, (first, later)
    assert breaker.state.value == "open"
    totals = reader.offload.totals.data
    # One full wait opened the breaker once, and the requests after it skipped the
    # store. Which check ends that wait is a race between two in the scheduler: the
    # request's own (it counts mooncake_timeouts, then opens the breaker) or the
    # in-flight job's (it opens the breaker; the request, skipped on its next
    # lookup, counts a skip). A loaded host's slow step lets either come first.
    assert totals["mooncake_breaker_opens"] == 1
    assert totals.get("mooncake_timeouts", 0) <= 1
    assert totals["mooncake_breaker_skips"] >= 3
    assert "blocks_from_mooncake" not in totals

    os.killpg(master.proc.pid, signal.SIGCONT)
    tier = reader.worker.worker.tiers.nearest
    wait_until(lambda: reader.step() or tier.num_pending == 0, 30, "the stuck calls")
    time.sleep(max(0.0, WINDOW_S - max(later)))
    _serve(reader, "r1", _prompt(1))  # the probe: the writer's blocks are read
    assert breaker.state.value == "closed"
    assert reader.outputs["r1"] == writer.outputs["w1"] and reader.outputs["r0"] == \
        writer.outputs["w0"]
    assert totals["blocks_from_mooncake"] == 4 and totals["mooncake_breaker_closes"] == 1
    _serve(reader, "r5", _prompt(5))  # writes work again
    assert totals.get("blocks_to_mooncake", 0) >= 4
    reader.assert_idle()
