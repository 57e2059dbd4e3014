"""Shared set-up for the single-card end-to-end tests on vLLM's CPU platform."""

import pytest

from kvoffload_hal.testing import set_inprocess_env

set_inprocess_env()  # before vLLM reads its environment


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from kvoffload_hal.tiny_model import build_tiny_llama

    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))
