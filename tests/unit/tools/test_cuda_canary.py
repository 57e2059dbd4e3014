"""The GPU accuracy tests' corrupting control damages what the CUDA backend loads.

``tests/e2e/singlecard/corrupting_cuda_backend.py`` runs only in an engine on a GPU;
here it copies through the fake CUDA driver (real memmoves between CPU tensors
standing in for device memory and the registered host tier), by DMA and by the
copy kernel, and every loaded block must differ from the stored one exactly in its
even bytes.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parents[2]
for folder in (TESTS / "unit" / "backends" / "cuda", TESTS / "e2e" / "singlecard"):
    if str(folder) not in sys.path:
        sys.path.append(str(folder))  # after everything else: shadows nothing

from corrupting_cuda_backend import CorruptingCudaBackend  # noqa: E402
from cuda_fake import FAKE_SOURCE, VARIANTS, FakeDriver, flash_attn_rig  # noqa: E402

from kvoffload_hal.hal.backend import Direction, TransferJob  # noqa: E402
from support.native import compile_shared_library  # noqa: E402


class FakeCorruptingBackend(CorruptingCudaBackend):
    def _compute_stream_handle(self) -> int:
        return 0  # the legacy default stream, as torch reports it


@pytest.fixture(scope="module")
def fake_library(tmp_path_factory):
    return str(compile_shared_library(FAKE_SOURCE, tmp_path_factory.mktemp("fake_cuda"),
                                      ["-fvisibility=hidden", *VARIANTS["cuda12_8"]],
                                      name="libfakecuda_canary.so"))


@pytest.mark.parametrize("kernel", ["off", "loads"], ids=["dma", "copy-kernel"])
def test_loads_come_back_damaged_in_every_even_byte(fake_library, kernel):
    FakeDriver(fake_library).lib.fake_reset()
    rig = flash_attn_rig(FakeCorruptingBackend("cuda:0", library_path=fake_library,
                                               kernel_directions=kernel))
    try:
        assert (rig.backend.copy_kernel is None) == (kernel == "off")
        stored = rig.kv[:, [0, 1, 2]].clone()
        rig.backend.submit(TransferJob(0, Direction.STORE, [0, 1, 2], [5, 6, 7], "s"))
        assert all(r.ok for r in rig.backend.flush())
        assert np.array_equal(rig.host_view[:, [5, 6, 7]].numpy(), stored.numpy())
        rig.backend.submit(TransferJob(1, Direction.LOAD, [5, 6, 7], [10, 11, 12], "l"))
        assert all(r.ok for r in rig.backend.flush())
        loaded = rig.kv[:, [10, 11, 12]].numpy()
        assert np.array_equal(loaded[..., 1::2], stored.numpy()[..., 1::2])
        assert np.array_equal(loaded[..., ::2], stored.numpy()[..., ::2] + np.uint8(1))  # wraps
    finally:
        rig.close()
