"""vLLM 0.33's has_pending_block_frees: a running request that cannot grow waits for
device blocks a store in flight is about to give back, instead of being preempted."""

import random
import threading

import pytest

from kvoffload_hal.capabilities import sleeps_with_connectors
from support import backend_doubles

pytestmark = pytest.mark.skipif(not sleeps_with_connectors(),
                                reason="vLLM < 0.33 never asks has_pending_block_frees")


@pytest.fixture
def gate():
    backend_doubles.GatedCpuBackend.gate.set()
    yield backend_doubles.GatedCpuBackend.gate
    backend_doubles.GatedCpuBackend.gate.set()


def _prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1, 90) for _ in range(n)]


def _grow_while_a_store_holds_the_blocks(make_engine, gate, wait):
    """11 usable device blocks: A (5 blocks, one token) finishes at once and its
    blocks go to the CPU tier through copies held back for a second; B (5 blocks)
    decodes into the last free block, then needs one of A's. ``wait``: the connector
    answers vLLM's question (else vLLM's default, False). Returns the engine and
    whether the connector had blocks coming back when vLLM asked."""
    engine = make_engine(backend="gated-cpu", num_gpu_blocks=12)
    answers = []
    answer = engine.connector.has_pending_block_frees

    def asked():
        answers.append(answer())
        return answers[-1] and wait

    engine.connector.has_pending_block_frees = asked
    gate.clear()
    opener = threading.Timer(1.0, gate.set)
    opener.start()
    engine.add("A", _prompt(80, 1), max_tokens=1)
    engine.add("B", _prompt(80, 2), max_tokens=40)
    engine.run_until_done(max_steps=20_000)
    opener.join()
    engine.drain()
    engine.assert_idle()
    return engine, any(answers)


def test_a_request_waits_for_a_store_to_give_blocks_back(make_engine, gate):
    before, pending_before = _grow_while_a_store_holds_the_blocks(make_engine, gate, False)
    after, pending_after = _grow_while_a_store_holds_the_blocks(make_engine, gate, True)
    assert pending_before and pending_after  # A's store held its blocks when B needed one
    # vLLM's default preempts B, and that step's worker waits for every copy in flight.
    assert before.preemptions >= 1 and after.preemptions == 0
    assert any(m.need_flush for m in before.sent) and not any(m.need_flush for m in after.sent)
    assert after.outputs == before.outputs
