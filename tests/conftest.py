"""Fixtures shared by every suite."""

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random-weight Llama with its tokenizer, built offline once per session."""
    from kvoffload_hal.demo.tiny_model import build_tiny_llama

    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))
