"""scheduler_overhead.py times only the connector's calls unless asked for more."""

import pytest

so = pytest.importorskip("scheduler_overhead")


@pytest.fixture(scope="module")
def model():
    return so.build_tiny_llama(so.MODEL_DIR, so.MODEL)


def test_the_eviction_policys_hooks_are_timed_only_when_asked(model):
    # Their timers would run inside our connector's timed calls and be charged to
    # ours alone: a plain run leaves the policy as it is.
    plain = so.run_point(model, so.OURS, 200, 10, steps=3, warmup_steps=1, seed=0)
    assert "eviction_s" not in plain.extra
    assert plain.calls["build_connector_meta"] == 3
    timed = so.run_point(model, so.OURS, 200, 10, steps=3, warmup_steps=1, seed=0,
                         time_eviction=True)
    assert timed.extra["eviction_s"] >= 0
