"""Job bookkeeping shared by loads, stores and tier jobs: ids and rank reports."""

import itertools

import pytest

from kvoffload_hal.metadata import JobReport
from kvoffload_hal.scheduler.jobs import JobBook


def test_a_job_is_over_once_every_rank_reported():
    book = JobBook(world_size=3)
    job = book.send("payload")
    assert book.report(job, JobReport(ranks=2)) is None and job in book
    done = book.report(job, JobReport(ranks=1))
    assert done.payload == "payload" and not done.tally.failed and job not in book
    assert book.report(job, JobReport()) is None  # over: a late report is ignored


def test_ids_are_never_reused_whether_or_not_a_job_is_reported():
    book = JobBook(world_size=1)
    ids = [book.send(i) if i % 2 else book.new_id() for i in range(6)]
    assert ids == list(range(6)) and len(book) == 3
    assert sorted(book.payloads()) == [1, 3, 5] and book.get(3) == 3 and book.get(2) is None


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_one_failed_rank_fails_the_job_and_its_keys_in_any_report_order(order):
    reports = [JobReport(failed_keys=("k1",)), JobReport(failed=True),
               JobReport(failed_keys=("k2",))]
    book = JobBook(world_size=3)
    job = book.send(None)
    done = [book.report(job, reports[i]) for i in order][-1]
    assert done.tally.failed and done.tally.failed_keys == {"k1", "k2"}
