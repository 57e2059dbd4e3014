"""vLLM < 0.32, a hybrid model: a staged hit that fails after its check is refused by the
scheduler side itself (scheduler/secondary/staged_check.py, ``refuse_failure``).

That vLLM cannot recompute a failed load of several KV cache groups, so once a checked
hit was offered nothing it brings may fail. When a round's copy fails, the scheduler
stops the engine before it sends the hit's last round, which would have the workers
load the rest. (The workers stop it too, on a last round that reports unfilled blocks:
the test tells the two apart, and requires the scheduler's.)

vLLM's real scheduler and both connector roles (``engine_harness.py``); the first load
copy fails (``flaky-loads``).
"""

import pytest

from kvoffload_hal.capabilities import LoadFailedError, select_strategy

# Only where this vLLM's strategy checks a two-group model's staged hit first.
pytestmark = pytest.mark.skipif(not select_strategy(num_groups=2).checks_staged_hits_first(),
                                reason="vLLM >= 0.32 recomputes a failed load: no refusal")

BS = 16
PAGE = BS * 128
DOC_BLOCKS = 20


def _doc(seed):
    return [(seed * 7 + i) % 89 + 1 for i in range(DOC_BLOCKS * BS + 1)]


def _serve(engine, req_id, prompt):
    engine.add(req_id, prompt)
    engine.run_until_done(max_steps=3000)
    engine.drain()


def test_the_scheduler_refuses_a_checked_hit_whose_round_failed(make_engine, tmp_path):
    from support import flaky_backend  # noqa: F401 (registers flaky-loads: one load fails)

    engine = make_engine(backend="flaky-loads", cpu_blocks=12, num_gpu_blocks=72,
                         sliding_window=32, full_groups=2, sliding_groups=2,
                         max_num_batched_tokens=2 * BS, extra_config={
                             "disk_path": str(tmp_path / "kv"),
                             "disk_bytes_to_use": 1024 * PAGE})
    doc = _doc(1)
    _serve(engine, "first", doc)
    for i in range(2):  # the document leaves the device and the CPU tier
        _serve(engine, f"other-{i}", _doc(50 + i))
    assert engine.worker.worker.backend.failed_loads == 0  # the next load copy fails
    refused = []
    build = engine.connector.build_connector_meta  # the scheduler side's step

    def build_or_refuse(scheduler_output):
        try:
            return build(scheduler_output)
        except LoadFailedError as e:
            refused.append(str(e))
            raise

    engine.connector.build_connector_meta = build_or_refuse
    sent = len(engine.sent)
    engine.add("again", doc)
    with pytest.raises(LoadFailedError):
        engine.run_until_done(max_steps=3000)
    assert engine.worker.worker.backend.failed_loads == 1
    assert len(refused) == 1 and "request again failed after its check" in refused[0]
    rounds = [r for meta in engine.sent[sent:] if meta is not None for r in meta.rounds]
    assert rounds and not any(r.final for r in rounds)  # the last round never went out
    assert not engine.outputs["again"]  # no token: it never ran
