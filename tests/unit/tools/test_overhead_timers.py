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


def test_a_disk_tier_runs_behind_ours_with_its_jobs_reported(model, monkeypatch):
    """``--disk-tier``: the tier's jobs are sent and reported done every step, and its
    directory is gone after the run."""
    import os

    from kvoffload_hal.scheduler.secondary.chain import TierChain

    made, reports = [], []
    mkdtemp, on_reports = so.tempfile.mkdtemp, TierChain.on_reports
    monkeypatch.setattr(so.tempfile, "mkdtemp",
                        lambda **kwargs: made.append(mkdtemp(**kwargs)) or made[-1])
    monkeypatch.setattr(TierChain, "on_reports",
                        lambda self, r: reports.append(len(r)) or on_reports(self, r))
    point = so.run_point(model, so.OURS, 200, 10, steps=30, warmup_steps=1, seed=0,
                         disk_tier=True)
    assert point.stores > 0 and sum(reports) > 0
    assert made and not os.path.exists(made[0])
