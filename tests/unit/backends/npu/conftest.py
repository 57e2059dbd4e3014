"""Fixtures: the fake libascendcl compiled with gcc, a fake torch_npu, Ascend-like KV tensors.

The NPU backend runs unchanged on top of these: its ctypes code loads the fake
library through ``KVOFFLOAD_HAL_ACL_LIBRARY`` and its torch_npu calls reach
:class:`FakeNpuModule` installed as ``torch.npu``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from ascend_kv import AscendKv, ascend_kv
from fake_acl import SOURCE, VARIANTS, FakeAcl
from fake_torch_npu import FakeNpuModule, fake_torch_npu_module

from kvoffload_hal.backends.npu._acl import ACL_LIBRARY_ENV
from support.native import compile_shared_library


@pytest.fixture(scope="session")
def fake_libs(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("fake_acl")
    # One directory per variant, each holding a file named like the real one.
    return {name: compile_shared_library(SOURCE, out / name, flags, name="libascendcl.so")
            for name, flags in VARIANTS.items()}


@dataclass
class NpuEnv:
    """What a test gets: the fake runtime's hooks and the fake ``torch.npu``."""

    acl: FakeAcl
    npu: FakeNpuModule
    monkeypatch: pytest.MonkeyPatch
    libs: dict[str, Path]
    built: list = field(default_factory=list)

    def use(self, variant: str) -> FakeAcl:
        """Point the loader at another runtime variant (before the backend is built)."""
        self.acl = FakeAcl(self.libs[variant])
        self.monkeypatch.setenv(ACL_LIBRARY_ENV, str(self.acl.path))
        self.npu.acl_calls = self.acl.total_calls
        return self.acl

    def backend(self, variant: str = "full", **kwargs):
        from kvoffload_hal.backends.npu import NpuCopyBackend

        self.use(variant)
        backend = NpuCopyBackend(**kwargs)
        self.built.append(backend)
        return backend


@pytest.fixture
def npu_env(fake_libs, monkeypatch):
    acl = FakeAcl(fake_libs["full"])
    npu = FakeNpuModule(acl_calls=acl.total_calls)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu_module())
    monkeypatch.setenv(ACL_LIBRARY_ENV, str(acl.path))
    env = NpuEnv(acl, npu, monkeypatch, fake_libs)
    yield env
    for backend in env.built:  # no copy thread outlives its test
        backend.shutdown(timeout_s=5.0)


@pytest.fixture
def kv() -> AscendKv:
    return ascend_kv()
