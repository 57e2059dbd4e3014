"""long_doc_qa_probes.ConnectorTime: the pass's time in the connector, by what it does."""

import time

import pytest

probes = pytest.importorskip("long_doc_qa_probes")


class Worker:
    """Two of the connector's method names, one calling the other."""

    def bind_connector_metadata(self, wait_s):
        time.sleep(wait_s)

    def get_transfer_results(self, wait_s):
        self.get_finished(wait_s)  # counted once, in the outer call
        return "results"

    def get_finished(self, wait_s):
        time.sleep(wait_s)


def test_calls_are_summed_by_group_and_a_nested_call_counts_once():
    timer = probes.ConnectorTime(Worker)
    worker = Worker()
    with timer.measuring():
        worker.bind_connector_metadata(0.02)
        assert worker.get_transfer_results(0.03) == "results"
    assert set(timer.seconds) == {"rescues", "after forward"}
    assert 0.02 <= timer.seconds["rescues"] < 0.03
    assert 0.03 <= timer.seconds["after forward"] < 0.05  # not 0.06: counted once


def test_the_class_is_as_before_once_measuring_ends():
    before = dict(Worker.__dict__)
    timer = probes.ConnectorTime(Worker)
    with pytest.raises(RuntimeError), timer.measuring():
        raise RuntimeError("the pass failed")
    assert dict(Worker.__dict__) == before
    Worker().get_finished(0)
    assert timer.seconds == {}  # no call is timed outside the block


def test_every_timed_name_is_a_method_of_the_connector():
    # A renamed connector method would silently drop out of the sums (only methods the
    # class itself defines are wrapped).
    from kvoffload_hal.connector import HALOffloadConnector

    names = {n for group in probes.GROUPS.values() for n in group}
    missing = names - set(vars(HALOffloadConnector))
    assert missing == set()
