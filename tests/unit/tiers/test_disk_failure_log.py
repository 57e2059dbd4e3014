"""The disk tier's failed writes and reads in the log: a kind of failure is logged at
once, then at most once per window with how many failed, so a disk that fills up
again later is in the log again (the soak fills the disk tier's tmpfs several times
in a run; each time must show)."""

import logging

import pytest
import torch

from kvoffload_hal.tiers.disk import worker
from kvoffload_hal.tiers.disk.failures import FailureLog
from support.clock import FakeClock
from support.polling import collect_results


@pytest.fixture
def tier(tmp_path):
    t = worker.DiskTier(str(tmp_path), rank=0,
                        host_views=[torch.zeros(4, 4096, dtype=torch.uint8)])
    yield t
    t.shutdown()


def _full_disk(path, data):
    raise OSError(28, "No space left on device")


def _store(tier, job_id, key):
    tier.submit_store(job_id, [(key, 0)])
    [result] = collect_results(tier.poll, 1)
    assert result.failed_keys == (key,)


def test_a_disk_full_again_after_the_window_is_logged_again(tier, monkeypatch, caplog):
    clock = FakeClock()
    monkeypatch.setattr(worker, "FAILURES", FailureLog(worker.logger, 30.0, clock))
    monkeypatch.setattr(tier, "_write_file", _full_disk)
    caplog.set_level(logging.WARNING, logger=worker.logger.name)
    _store(tier, 0, "aa01")
    _store(tier, 1, "aa02")  # within the window: counted, not said
    clock.now += 31
    _store(tier, 2, "aa03")
    lines = [r.getMessage() for r in caplog.records if "failed with" in r.getMessage()]
    assert lines == [
        "disk tier: writing a block failed with OSError (ENOSPC); such blocks are recomputed",
        "disk tier: writing 2 block(s) failed with OSError (ENOSPC) in the last 31 s; such "
        "blocks are recomputed"], lines


def test_reads_and_writes_are_kinds_of_their_own(tier, monkeypatch, caplog):
    monkeypatch.setattr(worker, "FAILURES", FailureLog(worker.logger, 30.0, FakeClock()))
    monkeypatch.setattr(tier, "_write_file", _full_disk)
    caplog.set_level(logging.WARNING, logger=worker.logger.name)
    _store(tier, 0, "bb01")
    tier.submit_load(1, [("bb02", 1)])  # no such file
    assert collect_results(tier.poll, 1)[0].failed_keys == ("bb02",)
    said = [r.getMessage() for r in caplog.records if "failed with" in r.getMessage()]
    assert len(said) == 2 and "reading a block failed with FileNotFoundError (ENOENT)" in said[1]
