"""The connector's counts reach vLLM's published stats while the engine still steps.

vLLM publishes connector stats from each step's output. The scheduler side counts
blocks loaded and stored when it reads the workers' job reports, after vLLM took
that step's stats; vLLM 0.23 takes the scheduler's stats only beside a worker's.
"""

import random

BS = 16


def _docs(n, length, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 90) for _ in range(length)] for _ in range(n)]


def test_the_last_loads_are_published_before_the_engine_goes_idle(make_engine):
    engine = make_engine()
    docs = _docs(6, 80)  # 5 blocks each; the device holds 19
    for i, d in enumerate(docs):
        engine.add(f"a{i}", d)
    engine.run_until_done()
    engine.drain()
    for i, d in enumerate(docs):
        engine.add(f"b{i}", d + [5, 6])
    engine.run_until_done()  # no idle step after the last request

    totals = engine.offload.totals.data
    assert totals["cpu_hit_tokens"] == 6 * 80
    for key in ("cpu_hit_tokens", "blocks_loaded", "blocks_stored"):
        assert engine.published[key] == totals[key], key
    worker_totals = engine.worker.worker.totals.data
    assert engine.published["bytes_loaded"] == worker_totals["bytes_loaded"] > 0
