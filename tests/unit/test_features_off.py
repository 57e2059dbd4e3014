"""A feature that is off costs nothing per step: the scheduler side does not call it.

On vLLM's real scheduler with the model that checks every KV read
(``engine_harness.py``): the per-step calls of rescues (``device_copies: drop``),
staged hits and the tier chain (a disk or Mooncake tier) and prefetch are counted
while requests run, with each feature off and on.
"""

import random

import pytest

BS = 16


def _count_calls(monkeypatch):
    """The step's calls of each feature, counted by name."""
    from kvoffload_hal.scheduler.secondary.chain import TierChain
    from kvoffload_hal.scheduler.secondary.prefetch import NullPrefetcher, Prefetcher
    from kvoffload_hal.scheduler.secondary.staged import StagedHits
    from kvoffload_hal.scheduler.store_jobs import StoreJobs

    calls = {}
    for cls, name in ((StoreJobs, "rescue"), (StagedHits, "advance"),
                      (StagedHits, "take_rounds"), (TierChain, "take_jobs"),
                      (TierChain, "on_reports"), (NullPrefetcher, "step"),
                      (Prefetcher, "step")):
        def counted(self, *args, _name=name, _call=getattr(cls, name), **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _call(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, counted)
    return calls


def _run(engine):
    rng = random.Random(0)
    docs = [[rng.randrange(1, 90) for _ in range(4 * BS + 1)] for _ in range(8)]
    for tag in "ab":  # more blocks than the device holds: the second pass loads
        for i, doc in enumerate(docs):
            engine.add(f"{tag}{i}", doc, max_tokens=2)
            engine.run_until_done()
        engine.drain()
    engine.assert_idle()


@pytest.mark.parametrize("feature", ["none", "rescues", "tiers"])
def test_the_step_calls_only_the_features_that_are_on(make_engine, monkeypatch, tmp_path,
                                                       feature):
    extra = {"none": {}, "rescues": {"device_copies": "drop"},
             "tiers": {"disk_path": str(tmp_path / "kv"), "disk_bytes_to_use": 2**24}}[feature]
    calls = _count_calls(monkeypatch)
    engine = make_engine(extra_config=extra)
    _run(engine)
    assert engine.offload.totals.data["blocks_loaded"] > 0
    called = set(calls)
    if feature == "none":
        assert called == set()
    elif feature == "rescues":
        assert called == {"rescue"}
    else:
        assert {"advance", "take_rounds", "take_jobs", "on_reports", "step"} <= called
        assert "rescue" not in called
