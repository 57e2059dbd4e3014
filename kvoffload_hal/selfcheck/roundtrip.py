"""Byte-exact round trips of scattered blocks through one copy backend.

One check, for one layout and one block size:

1. bind a fresh backend to random "device" KV tensors (views of flat buffers) and
   to a host buffer it allocated, prefilled with other random bytes;
2. store: copy random device blocks to random host blocks (device -> host), then
   compare the WHOLE host buffer with what it must hold: the stored blocks
   where they were sent, the prefill everywhere else;
3. load: copy those host blocks to other random device blocks (host -> device),
   then compare every device buffer byte for byte with what it must hold: the
   loaded blocks where they were sent, the original bytes everywhere else
   (the blocks around them, and the padding between blocks).

A mismatch names the region, the block and the byte offset of the first wrong byte.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvoffload_hal.hal.backend import Direction, DmaCopyBackend, JobResult, TransferJob
from kvoffload_hal.hal.layouts import describe_kv_caches
from kvoffload_hal.hal.regions import BlockRegion, host_bytes_per_block, host_regions_for
from kvoffload_hal.selfcheck.kv_layouts import build_layout
from kvoffload_hal.selfcheck.session import backend_session

__all__ = ["NUM_DEVICE_BLOCKS", "NUM_HOST_BLOCKS", "RoundTrip", "check_round_trip"]

NUM_DEVICE_BLOCKS = 32
NUM_HOST_BLOCKS = 24
NUM_COPIED_BLOCKS = 12  # per direction; the rest of each side must stay untouched

BackendFactory = Callable[[], DmaCopyBackend]


@dataclass
class RoundTrip:
    """Outcome of one round trip. ``error`` is one line when something went wrong."""

    layout: str
    block_size: int
    regions: int = 0
    bytes_per_block: int = 0
    blocks: int = NUM_COPIED_BLOCKS
    store_ok: bool = False
    load_ok: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.store_ok and self.load_ok and self.error is None


@dataclass(frozen=True)
class _Placed:
    """A device region as an offset into one of the layout's flat buffers."""

    region: BlockRegion
    buffer: int
    offset: int


def _place(regions: Sequence[BlockRegion], buffers: Sequence[torch.Tensor]) -> list[_Placed]:
    placed = []
    for r in regions:
        for i, buf in enumerate(buffers):
            offset = r.base_ptr - buf.data_ptr()
            if 0 <= offset and offset + r.span_bytes <= buf.numel():
                placed.append(_Placed(r, i, offset))
                break
        else:
            raise ValueError(f"region at 0x{r.base_ptr:x} lies in no buffer of the layout")
    return placed


def _block(flat: torch.Tensor, offset: int, stride: int, size: int, block: int) -> torch.Tensor:
    start = offset + block * stride
    return flat[start:start + size]


def _first_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> int | None:
    diff = torch.nonzero(actual != expected)
    return int(diff[0, 0]) if diff.numel() else None


def _where(offset: int, spans: Sequence[tuple[int, int, BlockRegion]], written: np.ndarray) -> str:
    """``offset`` in terms of ``(region index, offset in the buffer, region)`` spans, and
    whether the job was asked to write that block (``written`` block ids)."""
    for index, start, region in spans:
        block, within = divmod(offset - start, region.block_stride_bytes)
        if offset >= start and within < region.block_bytes and block < region.num_blocks:
            role = "a block the job wrote" if block in written else "a block the job must not touch"
            return f"region {index} block {block} byte {within} ({role})"
    return "outside every block (padding or unused bytes)"


def _run(backend: DmaCopyBackend, job: TransferJob) -> JobResult:
    backend.submit(job)
    results = [r for r in backend.flush()
               if r.job_id == job.job_id and r.direction is job.direction]
    if len(results) != 1:
        raise RuntimeError(f"{job.direction.value} job {job.job_id}: {len(results)} results, "
                           "expected 1")
    return results[0]


def _store(backend: DmaCopyBackend, placed: list[_Placed], host: torch.Tensor,
           device_before: list[torch.Tensor], src: np.ndarray, dst: np.ndarray) -> str | None:
    """Store ``src`` device blocks into ``dst`` host blocks; None when every host byte is right."""
    expected = host.clone()
    spans, offset = [], 0
    for i, p in enumerate(placed):
        size = p.region.block_bytes
        for s, d in zip(src.tolist(), dst.tolist()):
            _block(expected, offset, size, size, d).copy_(
                _block(device_before[p.buffer], p.offset, p.region.block_stride_bytes, size, s))
        host_region = BlockRegion(host.data_ptr() + offset, NUM_HOST_BLOCKS, size, size)
        spans.append((i, offset, host_region))
        offset += NUM_HOST_BLOCKS * size
    result = _run(backend, TransferJob(0, Direction.STORE, src, dst))
    if not result.ok:
        return f"store job failed: {result.error}"
    bad = _first_mismatch(host, expected)
    if bad is not None:
        return f"store (device -> host): host byte {bad} is wrong, {_where(bad, spans, dst)}"
    return None


def _load(backend: DmaCopyBackend, placed: list[_Placed], host: torch.Tensor,
          device_before: list[torch.Tensor], buffers: list[torch.Tensor], src: np.ndarray,
          dst: np.ndarray) -> str | None:
    """Load ``src`` host blocks into ``dst`` device blocks; None when every device byte is right."""
    expected = [b.clone() for b in device_before]
    offset = 0
    for p in placed:
        size, stride = p.region.block_bytes, p.region.block_stride_bytes
        for s, d in zip(src.tolist(), dst.tolist()):
            _block(expected[p.buffer], p.offset, stride, size, d).copy_(
                _block(host, offset, size, size, s))
        offset += NUM_HOST_BLOCKS * size
    result = _run(backend, TransferJob(0, Direction.LOAD, src, dst))
    if not result.ok:
        return f"load job failed: {result.error}"
    for i, buf in enumerate(buffers):
        bad = _first_mismatch(buf.cpu(), expected[i])
        if bad is not None:
            spans = [(k, p.offset, p.region) for k, p in enumerate(placed) if p.buffer == i]
            return (f"load (host -> device): byte {bad} of device buffer {i} is wrong, "
                    f"{_where(bad, spans, dst)}")
    return None


def check_round_trip(make_backend: BackendFactory, layout: str, block_size: int,
                     tensor_device: torch.device | str, seed: int) -> RoundTrip:
    """One round trip of ``layout`` at ``block_size`` tokens per block; see the module."""
    outcome = RoundTrip(layout, block_size)
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    build = build_layout(layout, NUM_DEVICE_BLOCKS, block_size, tensor_device, gen)
    with backend_session(make_backend, outcome) as session:
        backend = session.backend
        regions = describe_kv_caches(build.kv_caches, NUM_DEVICE_BLOCKS, backend.describe_kv_tensor)
        placed = _place(regions, build.buffers)
        outcome.regions, outcome.bytes_per_block = len(regions), host_bytes_per_block(regions)
        host = session.allocate_host(NUM_HOST_BLOCKS * outcome.bytes_per_block)
        host.copy_(torch.randint(0, 256, (host.numel(),), dtype=torch.uint8, generator=gen))
        backend.bind(regions, host_regions_for(regions, host.data_ptr(), NUM_HOST_BLOCKS))
        device_before = [b.cpu().clone() for b in build.buffers]
        stored = rng.choice(NUM_DEVICE_BLOCKS, NUM_COPIED_BLOCKS, replace=False)
        host_ids = rng.choice(NUM_HOST_BLOCKS, NUM_COPIED_BLOCKS, replace=False)
        others = np.setdiff1d(np.arange(NUM_DEVICE_BLOCKS), stored)
        loaded = rng.choice(others, NUM_COPIED_BLOCKS, replace=False)
        outcome.error = _store(backend, placed, host, device_before, stored, host_ids)
        outcome.store_ok = outcome.error is None
        if outcome.store_ok:
            outcome.error = _load(backend, placed, host, device_before, build.buffers,
                                  host_ids, loaded)
            outcome.load_ok = outcome.error is None
    return outcome
