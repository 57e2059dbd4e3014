"""Print the distributions a plain engine run imports (the source of needed_dists.txt).

    .venv-vllm023/bin/python tools/gpu/trace_imports.py

Runs a tiny random-weight Llama in-process on vLLM's CPU platform with
HALOffloadConnector, one greedy request, then maps every imported top-level module
to the distributions that provide it.
"""

from __future__ import annotations

import os
import sys
import tempfile


def imported_distributions() -> list[str]:
    from importlib.metadata import packages_distributions

    provided = packages_distributions()
    tops = {name.split(".")[0] for name in list(sys.modules)}
    return sorted({dist for top in tops for dist in provided.get(top, [])})


def main() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm import SamplingParams

    from kvoffload_hal.demo.inprocess import EngineSpec, close_llm, make_llm
    from kvoffload_hal.demo.tiny_model import build_tiny_llama, synthetic_text

    with tempfile.TemporaryDirectory() as tmp:
        llm = make_llm(EngineSpec(build_tiny_llama(tmp), num_gpu_blocks=24, offload=True))
        try:
            llm.generate([synthetic_text(100, seed=1)],
                         SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        finally:
            close_llm(llm)
    print("\n".join(imported_distributions()))


if __name__ == "__main__":
    main()
