"""The pooled-IO base every worker half runs on: jobs, faults, bounded shutdown."""

import threading

from kvoffload_hal.tiers.worker_pool import PooledTier
from support.polling import collect_results


class _Tier(PooledTier):
    name = "test"
    label = "test tier"
    batch_items = 2

    def __init__(self):
        self.calls = []
        self.gate = threading.Event()
        self.gate.set()
        self.closed = None
        super().__init__()

    def _store_batch(self, items):
        self.gate.wait()
        self.calls.append([k for k, _ in items])
        return [k for k, _ in items if k.startswith("bad")]

    def _load_batch(self, items):
        raise OSError("the medium is gone")

    def _close(self, idle):
        self.closed = idle


def _results(tier, n):
    return {r.job_id: r for r in collect_results(tier.poll, n)}


def test_jobs_are_split_into_batches_and_report_their_failed_keys_once():
    tier = _Tier()
    tier.submit_store(1, [("a", 0), ("bad1", 1), ("c", 2)])
    tier.submit_store(2, [("d", 3)])
    results = _results(tier, 2)
    assert results[1].failed_keys == ("bad1",) and results[2].ok
    assert sorted(map(len, tier.calls)) == [1, 1, 2]  # two items per call at most
    assert tier.poll() == [] and tier.num_pending == 0
    assert tier.shutdown(1.0) and tier.closed is True


def test_a_call_that_raises_fails_its_keys_and_logs_once(caplog):
    tier = _Tier()
    tier.submit_load(7, [("a", 0), ("b", 1), ("c", 2)])
    tier.submit_load(8, [("d", 3)])
    results = _results(tier, 2)
    assert results[7].failed_keys == ("a", "b", "c") and results[8].failed_keys == ("d",)
    warnings = [r for r in caplog.records if "test tier: a call failed with OSError" in
                r.getMessage()]
    assert len(warnings) == 1
    tier.shutdown(1.0)


def test_a_probe_on_a_tier_without_queries_fails_its_keys():
    tier = _Tier()
    tier.submit_probe(3, ["x", "y"])
    assert _results(tier, 1)[3].failed_keys == ("x", "y")
    tier.shutdown(1.0)


def test_shutdown_gives_up_on_a_stuck_call_and_closes_only_what_is_safe():
    tier = _Tier()
    tier.gate.clear()
    tier.submit_store(1, [("a", 0)])
    tier.submit_store(2, [("b", 1)] * 6)  # queued behind: cancelled by the shutdown
    assert tier.shutdown(0.2) is False and tier.closed is False
    tier.gate.set()
