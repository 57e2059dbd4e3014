"""Fixtures shared by every suite, and the platform the suite runs vLLM on."""

import os

import pytest

from support.vllm_build import cpu_kernels_missing, use_cpu_platform

use_cpu_platform()  # before anything asks vLLM for its platform (support/vllm_build.py)


def _one_core_per_worker() -> None:
    """Under pytest-xdist (``make test`` runs tests in one process per core), each
    process and the engines it starts keep to a core of their own: vLLM's CPU worker
    binds an OpenMP thread to every core it is given, and two engines sharing the cores
    would each wait on the other's spinning threads. Tests whose processes need a core
    each (marked ``two_cores``: ranks, or engines and a store answering each other within
    timeouts) run outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...
    cores = sorted(os.sched_getaffinity(0))
    if not worker.startswith("gw") or len(cores) < 2:
        return
    core = cores[int(worker[2:]) % len(cores)]
    os.sched_setaffinity(0, {core})  # inherited by every process it starts
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)


_one_core_per_worker()


def pytest_collection_modifyitems(config, items):
    """Tests that run a real model (marked ``e2e`` or ``cpu_kernels``) skip, saying
    why, where this vLLM build has no CPU kernels (the vLLM 0.33 lane). On a GPU
    (``VLLM_TARGET_DEVICE=cuda`` set before the run) they use its kernels."""
    needs = [item for item in items
             if item.get_closest_marker("e2e") or item.get_closest_marker("cpu_kernels")]
    reason = cpu_kernels_missing() if needs and _on_cpu_platform() else None
    if reason is not None:
        for item in needs:
            item.add_marker(pytest.mark.skip(reason=reason))


def _on_cpu_platform() -> bool:
    return os.environ.get("VLLM_TARGET_DEVICE", "cpu") == "cpu"


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
