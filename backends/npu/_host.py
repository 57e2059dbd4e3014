"""Page-locked host memory of the NPU backend: ``aclrtMallocHost``, in chunks for a large tier.

Contract:

* :meth:`NpuHostMemory.allocate` returns one ``aclrtMallocHost`` block of
  ``num_bytes`` as a 1-D ``uint8`` tensor (the HAL's ``allocate_host``: one
  contiguous buffer, so one call whatever its size).
* :meth:`NpuHostMemory.allocate_regions` lays out the CPU tier's host regions
  (region ``i`` mirrors device region ``i``, ``num_host_blocks`` dense blocks
  each) over several ``aclrtMallocHost`` calls of at most ``chunk_bytes`` each.
  A region is never split: each lies wholly in one chunk, so no block's host
  slot straddles two chunks, and every region stays one
  :class:`~kvoffload_hal.hal.regions.BlockRegion` that ``bind`` takes as it is.
  Regions keep their order and sit back to back, so the chunks laid end to end
  are byte for byte the one-buffer layout of
  :func:`~kvoffload_hal.hal.regions.host_regions_for`. A region larger than
  ``chunk_bytes`` is refused before any call. If chunk ``k`` fails, chunks
  ``0..k-1`` are freed and :class:`AclError` names the tier's size, the chunk,
  its size and the ACL error code.
* :meth:`NpuHostMemory.free` / :meth:`NpuHostMemory.free_regions` return every
  chunk with ``aclrtFreeHost`` (all are tried even if one fails; the first
  error is raised afterwards).

Why chunks: one ``aclrtMallocHost`` call above about 200-250 GB fails on Atlas
A2 (910B) with ``ACL_ERROR_RT_MEMORY_ALLOCATION`` (207001) although the host has
the memory free (LMCache-Ascend issue #242), while the per-rank CPU tier of a
large host can be several hundred GiB. Why not one virtual range pinned in
chunks, as the CUDA backend does: ``aclrtHostRegister`` returns a device-side
mapping the runtime documents as unusable for copies, and separate
``aclrtMallocHost`` calls return unrelated addresses.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence

import torch

from kvoffload_hal.backends.npu._acl import ACL_ERROR_RT_MEMORY_ALLOCATION, AclError, AclRuntime
from kvoffload_hal.hal.host import HostChunks
from kvoffload_hal.hal.regions import BlockRegion
from kvoffload_hal.logger import init_logger

logger = init_logger(__name__)

#: Environment variable capping the bytes of one ``aclrtMallocHost`` call of the tier.
HOST_CHUNK_BYTES_ENV = "KVOFFLOAD_HAL_NPU_HOST_CHUNK_BYTES"
# 64 GiB: well under the ~200-250 GB at which single aclrtMallocHost calls failed with
# 207001 on a 910B with 1.7 TB free (LMCache-Ascend issue #242), and the chunk the CUDA
# backend registers host memory in (backends/cuda/_host.py, from vLLM #51080/#51081).
DEFAULT_HOST_CHUNK_BYTES = 64 << 30

GiB = float(1 << 30)


def plan_host_chunks(region_bytes: Sequence[int], chunk_bytes: int) -> list[range]:
    """Consecutive regions grouped into chunks of at most ``chunk_bytes``, none split.

    Greedy: a chunk takes regions in order until the next one would not fit.
    Raises ``ValueError`` naming the first region larger than ``chunk_bytes``.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if not region_bytes:
        raise ValueError("no host regions to allocate")
    chunks, start, filled = [], 0, 0
    for i, size in enumerate(region_bytes):
        if size > chunk_bytes:
            raise ValueError(
                f"host region {i} needs {size} bytes ({size / GiB:.2f} GiB), more than one "
                f"aclrtMallocHost chunk of {chunk_bytes} bytes ({HOST_CHUNK_BYTES_ENV}); a region "
                f"is never split across chunks: raise {HOST_CHUNK_BYTES_ENV} (single calls above "
                f"about 200-250 GB fail on Atlas A2) or lower cpu_bytes_to_use")
        if filled + size > chunk_bytes:
            chunks.append(range(start, i))
            start, filled = i, 0
        filled += size
    chunks.append(range(start, len(region_bytes)))
    return chunks


class NpuHostMemory:
    """Allocates and frees the backend's ``aclrtMallocHost`` memory; owns the pointers."""

    def __init__(self, acl: AclRuntime, chunk_bytes: int = DEFAULT_HOST_CHUNK_BYTES) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"host chunk size must be positive, got {chunk_bytes} bytes")
        self._acl = acl
        self.chunk_bytes = chunk_bytes
        self._buffers: dict[int, int] = {}  # allocate(): pointer -> bytes
        self._tiers: dict[int, tuple[int, ...]] = {}  # allocate_regions(): first -> all

    def __len__(self) -> int:
        """Allocations not freed yet (buffers and chunked tiers)."""
        return len(self._buffers) + len(self._tiers)

    def allocate(self, num_bytes: int) -> torch.Tensor:
        if num_bytes <= 0:
            raise ValueError(f"host allocation must be positive, got {num_bytes} bytes")
        [tensor] = self._malloc_chunks([num_bytes], "host buffer")
        self._buffers[tensor.data_ptr()] = num_bytes
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        ptr = tensor.data_ptr()
        if self._buffers.pop(ptr, None) is None:
            raise ValueError("free_host: this tensor was not allocated by this backend")
        self._acl.free_host(ptr)

    def allocate_regions(self, device_regions: Sequence[BlockRegion],
                         num_host_blocks: int) -> HostChunks:
        if num_host_blocks <= 0:
            raise ValueError(f"num_host_blocks must be positive, got {num_host_blocks}")
        sizes = [num_host_blocks * r.block_bytes for r in device_regions]
        plan = plan_host_chunks(sizes, self.chunk_bytes)
        started = time.perf_counter()
        chunks = self._malloc_chunks([sum(sizes[i] for i in group) for group in plan],
                                     "host tier")
        regions, chunk_of = [], []
        for k, group in enumerate(plan):
            offset = 0
            for i in group:
                block_bytes = device_regions[i].block_bytes
                regions.append(BlockRegion(chunks[k].data_ptr() + offset, num_host_blocks,
                                           block_bytes, block_bytes))
                chunk_of.append(k)
                offset += sizes[i]
        tier = HostChunks(tuple(chunks), tuple(regions), tuple(chunk_of))
        self._tiers[chunks[0].data_ptr()] = tuple(c.data_ptr() for c in chunks)
        logger.info("kvoffload_hal npu: host tier of %.2f GiB in %d aclrtMallocHost call(s) of "
                    "at most %.2f GiB, %.2f s", tier.num_bytes / GiB, len(chunks),
                    self.chunk_bytes / GiB, time.perf_counter() - started)
        return tier

    def free_regions(self, tier: HostChunks) -> None:
        pointers = tuple(c.data_ptr() for c in tier.chunks)
        if not pointers or self._tiers.get(pointers[0]) != pointers:
            raise ValueError("free_host_regions: these chunks were not allocated by this "
                             "backend or were already freed")
        del self._tiers[pointers[0]]
        first_error = self._free_all(pointers)
        if first_error is not None:
            raise first_error

    def _malloc_chunks(self, sizes: Sequence[int], what: str) -> list[torch.Tensor]:
        """One ``aclrtMallocHost`` per size; on a failure the earlier chunks are freed."""
        total, pointers = sum(sizes), []
        try:
            for k, size in enumerate(sizes):
                try:
                    pointers.append(self._acl.malloc_host(size))
                except AclError as e:
                    raise AclError(_chunk_error(what, total, k, len(sizes), size, e),
                                   e.code) from e
            return [torch.frombuffer((ctypes.c_uint8 * size).from_address(ptr),
                                     dtype=torch.uint8) for ptr, size in zip(pointers, sizes)]
        except BaseException:
            self._free_all(pointers)
            raise

    def _free_all(self, pointers: Sequence[int]) -> Exception | None:
        first_error = None
        for ptr in pointers:
            try:
                self._acl.free_host(ptr)
            except Exception as e:  # noqa: BLE001 - keep freeing the rest
                first_error = first_error or e
        return first_error


def _chunk_error(what: str, total: int, index: int, count: int, size: int,
                 error: AclError) -> str:
    """One line: what was asked, which chunk failed, with what code, what to do."""
    freed = ("" if index == 0 else "; chunk 0 was freed" if index == 1
             else f"; chunks 0-{index - 1} were freed")
    message = (f"aclrtMallocHost failed with aclError {error.code} for chunk {index} of {count} "
               f"({size} bytes, {size / GiB:.2f} GiB) of a {total}-byte ({total / GiB:.2f} GiB) "
               f"{what}{freed}")
    if error.code == ACL_ERROR_RT_MEMORY_ALLOCATION:
        remedy = (f"lower {HOST_CHUNK_BYTES_ENV} or cpu_bytes_to_use" if what == "host tier"
                  else "lower cpu_bytes_to_use")
        message += (" (ACL_ERROR_RT_MEMORY_ALLOCATION: out of page-locked host memory, or one "
                    "call too large: Atlas A2 refuses single calls above about 200-250 GB, "
                    f"LMCache-Ascend issue #242; {remedy})")
    return message
