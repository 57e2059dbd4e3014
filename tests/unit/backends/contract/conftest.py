"""Fixtures of the contract tests, which run every built-in backend: the CUDA and NPU ones
on the fake runtimes that their own tests use (the helpers in ``../cuda`` and ``../npu``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support.native import compile_shared_library

_VENDOR_TESTS = Path(__file__).resolve().parent.parent

# The fakes' helper modules, importable by name as pytest makes them for the tests
# beside them.
for _folder in ("cuda", "npu"):
    if str(_VENDOR_TESTS / _folder) not in sys.path:
        sys.path.insert(0, str(_VENDOR_TESTS / _folder))


@pytest.fixture(scope="session")
def fake_library(tmp_path_factory):
    """``fake_library("cuda" | "npu", variant) -> Path``, each compiled once per session."""
    import cuda_fake
    import fake_acl

    out = tmp_path_factory.mktemp("contract_fakes")
    built: dict[tuple[str, str], Path] = {}

    def build(kind: str, variant: str) -> Path:
        if (kind, variant) not in built:
            if kind == "cuda":
                path = compile_shared_library(
                    cuda_fake.FAKE_SOURCE, out / kind,
                    ["-fvisibility=hidden", *cuda_fake.VARIANTS[variant]],
                    name=f"libfakecuda_{variant}.so")
            else:  # one folder per variant, the file named like the real library
                path = compile_shared_library(fake_acl.SOURCE, out / kind / variant,
                                              fake_acl.VARIANTS[variant], name="libascendcl.so")
            built[kind, variant] = path
        return built[kind, variant]

    return build
