"""The Mooncake fault tests' prefix-cache reset (support/mooncake_server.py): vLLM's
endpoint answers 200 even where the engine refused (a block still in use), which only
its log says; the probe asks again until the reset takes, and gives up after a while."""

import pytest

from support.mooncake_server import RESET_REFUSED, Probe


class LoggedServer:
    """An endpoint that refuses the first ``refusals`` resets, as vLLM does: 200, and a
    warning in the log."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.resets = 0
        self.text = "INFO started\n"

    def post(self, path: str) -> int:
        assert path == "/reset_prefix_cache"
        self.resets += 1
        if self.resets <= self.refusals:
            self.text += f"WARNING {RESET_REFUSED} because some blocks (3) are not freed yet\n"
        return 200

    def log(self) -> str:
        return self.text

    def client(self):
        return None


def test_a_refused_reset_is_asked_again_until_it_takes():
    server = LoggedServer(refusals=2)
    Probe(server).reset_device_cache()
    assert server.resets == 3


def test_a_reset_taken_at_once_is_asked_once():
    server = LoggedServer(refusals=0)
    Probe(server).reset_device_cache()
    assert server.resets == 1


def test_a_reset_refused_for_ever_fails_the_test():
    server = LoggedServer(refusals=10**6)
    with pytest.raises(AssertionError, match="kept refusing"):
        Probe(server).reset_device_cache(timeout_s=1.0)
