"""Fixtures: the fake CUDA driver built once per session with gcc, and bound backends."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from cuda_fake import FAKE_SOURCE, VARIANTS, FakeDriver, FakeGpuBackend, KvSetup


@pytest.fixture(scope="session")
def build_fake(tmp_path_factory):
    """``build_fake(variant) -> path`` of the compiled library, built once per session."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler (gcc/cc) to build the fake CUDA driver")
    out_dir = tmp_path_factory.mktemp("fake_cuda")
    built: dict[str, str] = {}

    def build(variant: str) -> str:
        if variant not in built:
            path = out_dir / f"libfakecuda_{variant}.so"
            subprocess.run(
                [gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-fvisibility=hidden",
                 "-pthread", *VARIANTS[variant], "-o", str(path), str(FAKE_SOURCE)],
                check=True, capture_output=True, text=True,
            )
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
    """``make_setup(**backend_kwargs)`` -> a bound :class:`KvSetup`; closed at teardown."""
    setups: list[KvSetup] = []

    def make(device: str = "cuda:0", setup_kwargs: dict | None = None, **kwargs) -> KvSetup:
        backend = FakeGpuBackend(device, library_path=fake.path, **kwargs)
        setups.append(KvSetup(backend, **(setup_kwargs or {})))
        return setups[-1]

    yield make
    for s in setups:
        if not s.backend._closed:
            s.close()
