"""Before any engine starts: does the installed bundle fit the machine it landed on?

    PYTHONPATH=SITE python3 tools/gpu/preflight.py SITE [--without-driver]

1. every requirement of every distribution installed in ``SITE`` on a distribution
   the run imports (``needed_dists.txt``) holds against what this Python really
   finds (the bundle first, then the machine's own packages);
2. the modules the engine run loads import: vLLM's CUDA platform and kernels, the
   FlashAttention backend, the GPU model runner, the Llama and Qwen models, vLLM's
   OffloadingConnector and this project's connector and CUDA backend.

Prints one line per problem; exit status 1 if there is any. ``--without-driver``
(``import_check.py``, a machine without a GPU): where ``libcuda.so.1`` does not load,
the modules whose kernels link it are listed as not checked instead.
"""

from __future__ import annotations

import ctypes
import importlib
import sys
from importlib.metadata import PackageNotFoundError, distributions, version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bundle_deps import canonicalize_name, load_needed, runtime_requires  # noqa: E402

MODULES = (
    "vllm", "vllm.platforms.cuda", "vllm._C", "vllm.vllm_flash_attn.flash_attn_interface",
    "vllm.v1.attention.backends.flash_attn", "vllm.v1.worker.gpu_model_runner",
    "vllm.model_executor.models.llama", "vllm.model_executor.models.qwen3",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    "kvoffload_hal.connector", "kvoffload_hal.backends.cuda",
)


#: Modules whose import loads kernels linked against the driver library.
NEED_DRIVER = ("vllm.platforms.cuda", "vllm._C", "vllm.vllm_flash_attn.flash_attn_interface")


def driver_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def requirement_problems(site: Path, needed: set[str]) -> list[str]:
    problems = []
    for dist in distributions(path=[str(site)]):
        for req in runtime_requires(dist.requires or []):
            target = canonicalize_name(req.name)
            if target not in needed:
                continue
            try:
                have = version(req.name)
            except PackageNotFoundError:
                problems.append(f"{dist.metadata['Name']} requires {req}: not installed")
                continue
            if not req.specifier.contains(have, prereleases=True):
                problems.append(f"{dist.metadata['Name']} requires {req}: found {have}")
    return problems


def import_problems(modules: tuple[str, ...] = MODULES) -> list[str]:
    problems = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # every failure is a finding, whatever its kind
            problems.append(f"import {name}: {type(e).__name__}: {e}")
    return problems


def main(argv: list[str]) -> int:
    site = Path(argv[0])
    problems = requirement_problems(site, set(load_needed()))
    modules = MODULES
    if "--without-driver" in argv[1:] and not driver_loads():
        modules = tuple(m for m in MODULES if m not in NEED_DRIVER)
        print(f"not checked (they need libcuda.so.1): {', '.join(NEED_DRIVER)}")
    problems += import_problems(modules)
    for line in problems:
        print(f"PROBLEM: {line}")
    import torch

    try:
        print(f"vllm {version('vllm')}, kvoffload-hal {version('kvoffload-hal')}")
    except PackageNotFoundError as e:
        print(f"not installed: {e}")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else None}")
    print("preflight: " + ("FAIL" if problems else "PASS"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
