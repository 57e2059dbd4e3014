"""The CUDA backend on a real GPU: random blocks device -> host -> device, byte for byte,
through the copy kernel (blocks of 16 KiB, and of 1000 bytes for its unaligned path), the
default split (loads by the kernel, stores by DMA) and DMA (the kernel off; chunked too).

Skipped unless ``torch.cuda.is_available()``; run with
``.venv/bin/python -m pytest -m cuda tests/unit/backends/cuda/test_real_gpu.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvoffload_hal.backends.cuda import CudaCopyBackend
from kvoffload_hal.hal.backend import Direction, TransferJob
from kvoffload_hal.hal.regions import host_regions_for

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

NUM_DEVICE_BLOCKS, NUM_HOST_BLOCKS = 256, 384
# FlashAttention-like (K/V, blocks, block_size, heads, head_dim) in bf16.
KV_SHAPE = (2, NUM_DEVICE_BLOCKS, 16, 8, 64)


# Backend settings per path: the kernel both ways (16 KiB blocks), the default (loads by
# the kernel, stores by DMA), DMA, chunked DMA.
PATHS = {"kernel": {"kernel_directions": "all"}, "default": {},
         "dma": {"kernel_directions": "off"},
         "dma-chunked": {"kernel_directions": "off", "max_descriptors": 7}}


@pytest.fixture(params=list(PATHS))
def backend_and_kv(request):
    backend = CudaCopyBackend("cuda:0", **PATHS[request.param])
    kv = torch.randn(KV_SHAPE, dtype=torch.bfloat16, device="cuda:0")
    device_regions = backend.describe_kv_tensor(kv, NUM_DEVICE_BLOCKS)
    block_bytes = device_regions[0].block_bytes
    host = backend.allocate_host(len(device_regions) * NUM_HOST_BLOCKS * block_bytes)
    backend.bind(device_regions, host_regions_for(device_regions, host.data_ptr(),
                                                  NUM_HOST_BLOCKS))
    assert (backend.copy_kernel is None) is request.param.startswith("dma")
    yield backend, kv, host
    backend.shutdown()
    backend.free_host(host)


def _pairs(rng: random.Random, n: int, num_src: int, num_dst: int):
    return rng.sample(range(num_src), n), rng.sample(range(num_dst), n)


@pytest.mark.parametrize("seed", range(3))
def test_round_trip_random_blocks(backend_and_kv, seed):
    backend, kv, host = backend_and_kv
    rng = random.Random(seed)
    original = kv.clone()
    src, dst = _pairs(rng, 64, NUM_DEVICE_BLOCKS, NUM_HOST_BLOCKS)
    backend.submit(TransferJob(0, Direction.STORE, src, dst))
    (result,) = backend.flush()
    assert result.ok, result.error
    host_view = host.view(torch.bfloat16).view(2, NUM_HOST_BLOCKS, *KV_SHAPE[2:])
    assert torch.equal(host_view[:, dst], original[:, src].cpu())

    kv.zero_()
    back = rng.sample(range(NUM_DEVICE_BLOCKS), 64)
    backend.submit(TransferJob(0, Direction.LOAD, dst, back))
    while backend.num_pending:
        results = backend.poll()
        assert all(r.ok for r in results), results
    torch.cuda.synchronize()
    assert torch.equal(kv[:, back], original[:, src])


def test_store_sees_compute_enqueued_before_submit(backend_and_kv):
    backend, kv, host = backend_and_kv
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy (~tens of ms)
    kv[:, 5].fill_(3.0)  # enqueued behind the sleep, on the compute stream
    backend.submit(TransferJob(0, Direction.STORE, [5], [9]))
    assert backend.flush()[0].ok
    host_view = host.view(torch.bfloat16).view(2, NUM_HOST_BLOCKS, *KV_SHAPE[2:])
    assert bool((host_view[:, 9] == 3.0).all())


def test_kernel_copies_unaligned_blocks():
    """1000-byte blocks: neither the addresses nor the sizes are multiples of 16."""
    backend = CudaCopyBackend("cuda:0", kernel_directions="all")
    kv = torch.randint(0, 256, (NUM_DEVICE_BLOCKS, 1000), dtype=torch.uint8, device="cuda:0")
    regions = backend.describe_kv_tensor(kv, NUM_DEVICE_BLOCKS)
    host = backend.allocate_host(NUM_HOST_BLOCKS * 1000)
    try:
        backend.bind(regions, host_regions_for(regions, host.data_ptr(), NUM_HOST_BLOCKS))
        src, dst = _pairs(random.Random(7), 100, NUM_DEVICE_BLOCKS, NUM_HOST_BLOCKS)
        backend.submit(TransferJob(0, Direction.STORE, src, dst))
        assert backend.flush()[0].ok and backend.copy_kernel is not None
        assert torch.equal(host.view(NUM_HOST_BLOCKS, 1000)[dst], kv[src].cpu())
        original = kv.clone()
        kv.zero_()
        backend.submit(TransferJob(1, Direction.LOAD, dst, src))
        assert backend.flush()[0].ok  # flushed: the load has ended
        assert torch.equal(kv[src], original[src])
    finally:
        backend.shutdown()
        backend.free_host(host)
