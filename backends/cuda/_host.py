"""Host memory of the offload tier: pageable tensors page-locked with ``cuMemHostRegister``.

Contract:

* :meth:`HostRegistry.allocate` returns a 1-D ``uint8`` CPU tensor of exactly
  ``num_bytes`` bytes whose first byte is page-aligned, registered with the
  driver in consecutive chunks of at most ``register_chunk_bytes``. If one chunk
  fails, the chunks already registered are unregistered and the error raised.
* :meth:`HostRegistry.free` unregisters every chunk of a tensor returned by
  ``allocate`` (all of them are tried even if one fails; the first error is
  raised afterwards). The tensor's memory is released with its last reference.

Why not ``torch.empty(..., pin_memory=True)``: PyTorch's pinned host allocator
rounds every allocation up to a power of two (100 GiB would pin 128 GiB).
Why chunks: one registration of 512 GiB or more fails with an out-of-memory
error although smaller ones covering the same bytes succeed (vLLM #51080).
Why page-aligned: chunk boundaries then fall on page boundaries, so no page is
shared by two registrations (the driver rejects overlapping registrations).
"""

from __future__ import annotations

import mmap

import torch

from kvoffload_hal.backends.cuda._driver import CudaDriver

__all__ = ["HostRegistry", "REGISTER_CHUNK_BYTES"]

# Largest single cuMemHostRegister call: 64 GiB, the chunk size vLLM adopted in
# #51081 after one-shot registrations of >= 512 GiB failed (#51080).
REGISTER_CHUNK_BYTES = 64 << 30

PAGE_BYTES = mmap.PAGESIZE


class HostRegistry:
    """Allocates, registers and unregisters host buffers; owns the chunk lists."""

    def __init__(self, driver: CudaDriver,
                 register_chunk_bytes: int = REGISTER_CHUNK_BYTES) -> None:
        if register_chunk_bytes <= 0 or register_chunk_bytes % PAGE_BYTES:
            raise ValueError(
                f"register_chunk_bytes must be a positive multiple of the page size "
                f"({PAGE_BYTES} B), got {register_chunk_bytes}"
            )
        self._driver = driver
        self.register_chunk_bytes = register_chunk_bytes
        # data_ptr of each allocated tensor -> [(chunk_ptr, chunk_bytes), ...]
        self._chunks: dict[int, list[tuple[int, int]]] = {}

    def __len__(self) -> int:
        return len(self._chunks)

    def allocate(self, num_bytes: int) -> torch.Tensor:
        if num_bytes <= 0:
            raise ValueError(f"host allocation must be positive, got {num_bytes} bytes")
        raw = torch.empty(num_bytes + PAGE_BYTES, dtype=torch.uint8)
        offset = -raw.data_ptr() % PAGE_BYTES
        tensor = raw[offset:offset + num_bytes]  # the view keeps ``raw`` alive
        base = tensor.data_ptr()
        chunks: list[tuple[int, int]] = []
        try:
            for start in range(0, num_bytes, self.register_chunk_bytes):
                size = min(self.register_chunk_bytes, num_bytes - start)
                self._driver.check(self._driver.cuMemHostRegister_v2(base + start, size, 0),
                                   "cuMemHostRegister")
                chunks.append((base + start, size))
        except BaseException:
            self._unregister(chunks)
            raise
        self._chunks[base] = chunks
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        chunks = self._chunks.pop(tensor.data_ptr(), None)
        if chunks is None:
            raise ValueError("free_host: this tensor was not returned by allocate_host "
                             "or was already freed")
        first_error = self._unregister(chunks)
        if first_error is not None:
            raise first_error

    def _unregister(self, chunks: list[tuple[int, int]]) -> Exception | None:
        first_error = None
        for ptr, _ in chunks:
            try:
                self._driver.check(self._driver.cuMemHostUnregister(ptr), "cuMemHostUnregister")
            except Exception as e:  # noqa: BLE001 - keep unregistering the rest
                first_error = first_error or e
        return first_error
