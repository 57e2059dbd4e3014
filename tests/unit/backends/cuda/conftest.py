"""Fixtures: the fake CUDA driver built once per session with gcc, and bound backends."""

from __future__ import annotations

import pytest
from cuda_fake import FAKE_SOURCE, VARIANTS, FakeDriver, FakeGpuBackend, flash_attn_rig

from support.backend_rig import BackendRig
from support.native import compile_shared_library


@pytest.fixture(scope="session")
def build_fake(tmp_path_factory):
    """``build_fake(variant) -> path`` of the compiled library, built once per session."""
    out_dir = tmp_path_factory.mktemp("fake_cuda")
    built: dict[str, str] = {}

    def build(variant: str) -> str:
        if variant not in built:
            # Hidden by default: the fake exports exactly the symbols it marks EXPORT.
            path = compile_shared_library(FAKE_SOURCE, out_dir,
                                          ["-fvisibility=hidden", *VARIANTS[variant]],
                                          name=f"libfakecuda_{variant}.so")
            built[variant] = str(path)
        return built[variant]

    return build


@pytest.fixture
def variant() -> str:
    return "cuda12_8"


@pytest.fixture
def fake(build_fake, variant) -> FakeDriver:
    driver = FakeDriver(build_fake(variant))
    driver.lib.fake_reset()
    return driver


@pytest.fixture
def make_setup(fake):
    """``make_setup(device, **backend_kwargs)`` -> a bound rig; closed at teardown."""
    setups: list[BackendRig] = []

    def make(device: str = "cuda:0", **kwargs) -> BackendRig:
        backend = FakeGpuBackend(device, library_path=fake.path, **kwargs)
        setups.append(flash_attn_rig(backend))
        return setups[-1]

    yield make
    for s in setups:
        if not s.backend._closed:
            s.close()
