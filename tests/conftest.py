"""Fixtures shared by every suite."""

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random-weight Llama with its tokenizer, built offline once per session."""
    from kvoffload_hal.demo.tiny_model import build_tiny_llama

    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory) -> str:
    """A random-weight Gemma 3 (sliding window + global layers), built offline once."""
    from kvoffload_hal.demo.tiny_hybrid import build_tiny_gemma3

    return build_tiny_gemma3(str(tmp_path_factory.mktemp("tiny-gemma3")))


@pytest.fixture(scope="session")
def tiny_qwen3_next_dir(tmp_path_factory) -> str:
    """A random-weight Qwen3-Next (Gated DeltaNet + attention, MoE), built offline once."""
    from kvoffload_hal.demo.tiny_hybrid import build_tiny_qwen3_next

    return build_tiny_qwen3_next(str(tmp_path_factory.mktemp("tiny-qwen3-next")))


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory) -> str:
    """A random-weight Qwen3-MoE (4 experts, 2 per token), built offline once."""
    from kvoffload_hal.demo.tiny_variants import build_tiny_qwen3_moe

    return build_tiny_qwen3_moe(str(tmp_path_factory.mktemp("tiny-qwen3-moe")))


@pytest.fixture(scope="session")
def tiny_eagle_dir(tmp_path_factory) -> str:
    """A one-layer random-weight EAGLE draft head for the tiny Llama, built offline once."""
    from kvoffload_hal.demo.tiny_variants import build_tiny_eagle

    return build_tiny_eagle(str(tmp_path_factory.mktemp("tiny-eagle")))
