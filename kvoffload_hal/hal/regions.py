"""Block-addressable byte regions and the copy descriptors built from them.

A KV cache tensor, whatever its layout, is described to the HAL as one or more
:class:`BlockRegion`: a base address, a block count, the bytes of one block and
the stride between blocks. Block ``i`` of a region occupies
``[base_ptr + i * block_stride_bytes, base_ptr + i * block_stride_bytes + block_bytes)``.

* :func:`describe_kv_tensor` derives the regions from a tensor's shape and
  strides, so no single layout is assumed (vLLM CPU ``[blocks, heads, block_size,
  2*head_dim]``, FlashAttention ``(2, blocks, ...)``, Ascend separate K/V tensors
  padded for alignment, cross-layer ``[blocks, layers, ...]``).
* :func:`build_copy_batch` turns a list of ``(src_block, dst_block)`` pairs over
  paired regions into flat ``(src_ptrs, dst_ptrs, sizes)`` arrays, merging runs of
  consecutive blocks into one descriptor when both sides are contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "BlockRegion",
    "CopyBatch",
    "build_copy_batch",
    "describe_kv_tensor",
    "host_regions_for",
    "merge_runs",
]


@dataclass(frozen=True)
class BlockRegion:
    """``num_blocks`` blocks of ``block_bytes`` bytes, ``block_stride_bytes`` apart."""

    base_ptr: int
    num_blocks: int
    block_bytes: int
    block_stride_bytes: int

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_bytes <= 0:
            raise ValueError(f"empty region: {self}")
        if self.block_stride_bytes < self.block_bytes:
            raise ValueError(f"blocks overlap: stride < block size in {self}")

    @property
    def contiguous(self) -> bool:
        """True when consecutive blocks are adjacent, so runs merge into one copy."""
        return self.block_stride_bytes == self.block_bytes

    @property
    def span_bytes(self) -> int:
        return (self.num_blocks - 1) * self.block_stride_bytes + self.block_bytes


def describe_kv_tensor(tensor: torch.Tensor, num_blocks: int) -> list[BlockRegion]:
    """Describe ``tensor`` as block regions, from its shape and strides only.

    The block dimension is a dimension of extent ``num_blocks``; dimensions
    with a larger stride are *outer* (e.g. the K/V axis of FlashAttention's
    ``(2, num_blocks, ...)``) and yield one region per index; dimensions with a
    smaller stride form the block itself, whose bytes are copied as one span
    (padding inside the span is copied along, which is harmless; padding
    between blocks, as in Ascend's 2 MiB-aligned K/V tensors, is not).

    Failing that, an *outermost* dimension (largest stride) of extent
    ``k * num_blocks`` is the block dimension, block ``i`` owning its rows
    ``[i * k, (i + 1) * k)``: vllm-ascend's kernel-block split
    (``num_blocks * (block_size // kernel_block_size)`` rows) and its
    DCP-replicated sparse indexer (``num_blocks * replicated_size`` rows) map a
    block to consecutive rows. The rows of one block share the dimension's
    stride, so they are evenly strided by construction. Only the outermost
    dimension qualifies, and only when no dimension of extent ``num_blocks``
    does, so that a per-token axis whose extent happens to be a multiple of the
    block count is never read as blocks.

    A candidate is consistent when the block's inner span fits in its stride
    and every outer dimension strides over all blocks. When several candidates
    are consistent (another dimension happens to have a fitting extent), the
    one with the largest block stride wins: vLLM's layouts put the block axis
    outside every per-token axis. The one layout this cannot tell apart is a
    K/V-outer ``(2, 2, ...)`` cache of exactly two blocks.

    Raises ``ValueError`` when no consistent decomposition exists.
    """
    if tensor.dim() == 0:
        raise ValueError("a KV cache tensor cannot be a scalar")
    elt = tensor.element_size()
    shape = list(tensor.shape)
    strides = [s * elt for s in tensor.stride()]
    if any(s < 0 for s in strides):
        raise ValueError(f"negative strides are not supported: {tensor.stride()}")
    attempts = {(d, 1): _decompose(shape, strides, d, elt, num_blocks)
                for d, n in enumerate(shape) if n == num_blocks}
    valid = [c for c, r in attempts.items() if not isinstance(r, str)]
    if not valid:
        attempts.update(_grouped_rows_attempt(shape, strides, elt, num_blocks))
        valid = [c for c, r in attempts.items() if not isinstance(r, str)]
    if not attempts:
        raise ValueError(
            f"no dimension of shape {tuple(shape)} strides {tensor.stride()} has the block "
            f"count {num_blocks}; expected one of extent {num_blocks}, or an outermost one "
            f"of {num_blocks} x k rows"
        )
    if not valid:
        reasons = "; ".join(str(r) for r in attempts.values())
        raise ValueError(
            f"shape {tuple(shape)} strides {tensor.stride()}: {reasons}; expected a dimension "
            f"of extent {num_blocks} (or an outermost one of {num_blocks} x k rows) outside "
            f"every other dimension"
        )
    outer, block_bytes, block_stride = attempts[max(valid, key=lambda c: attempts[c][2])]
    base = tensor.data_ptr()
    return [BlockRegion(base + o, num_blocks, block_bytes, block_stride) for o in outer]


def _grouped_rows_attempt(shape: list[int], strides: list[int], elt: int,
                          num_blocks: int) -> dict[tuple[int, int], tuple | str]:
    """The outermost dimension read as ``num_blocks`` groups of ``k`` consecutive rows,
    when its extent is ``k * num_blocks`` with ``k > 1``; empty otherwise."""
    sized = [d for d in range(len(shape)) if shape[d] > 1]
    if not sized:
        return {}
    dim = max(sized, key=lambda d: strides[d])
    rows, rest = divmod(shape[dim], num_blocks)
    if rest or rows < 2:
        return {}
    # Split dim into (blocks, rows per block); the rows become an inner dimension.
    split_shape = shape[:dim] + [num_blocks, rows] + shape[dim + 1:]
    split_strides = strides[:dim] + [rows * strides[dim], strides[dim]] + strides[dim + 1:]
    return {(dim, rows): _decompose(split_shape, split_strides, dim, elt, num_blocks)}


def _decompose(shape: list[int], strides: list[int], block_dim: int, elt: int,
               num_blocks: int) -> tuple[list[int], int, int] | str:
    """``(outer offsets, block bytes, block stride)`` with ``block_dim`` as the block
    dimension, or the reason it is not one."""
    stride = strides[block_dim]
    others = [d for d in range(len(shape)) if d != block_dim and shape[d] > 1]
    outer = [d for d in others if strides[d] > stride]
    inner = [d for d in others if strides[d] <= stride]
    block_bytes = sum((shape[d] - 1) * strides[d] for d in inner) + elt
    if num_blocks > 1 and block_bytes > stride:
        return (f"blocks overlap: block dim {block_dim} strides {stride} B but a "
                f"block spans {block_bytes} B")
    for d in outer:
        if strides[d] < num_blocks * stride:
            return (f"dimension {d} interleaves with the blocks (stride {strides[d]} B "
                    f"< {num_blocks} blocks x {stride} B)")
    offsets = [0]
    for d in outer:
        offsets = [o + i * strides[d] for o in offsets for i in range(shape[d])]
    return offsets, block_bytes, stride


def host_regions_for(
    device_regions: Sequence[BlockRegion], host_base_ptr: int, num_host_blocks: int
) -> list[BlockRegion]:
    """Lay out one dense host region per device region, back to back from ``host_base_ptr``.

    The host blocks hold only the useful ``block_bytes`` of each device block
    (device padding is not mirrored), so host regions are always contiguous.
    """
    regions = []
    offset = 0
    for r in device_regions:
        regions.append(BlockRegion(host_base_ptr + offset, num_host_blocks,
                                   r.block_bytes, r.block_bytes))
        offset += num_host_blocks * r.block_bytes
    return regions


def host_bytes_per_block(device_regions: Sequence[BlockRegion]) -> int:
    """Host bytes one offloaded block needs across all regions."""
    return sum(r.block_bytes for r in device_regions)


def merge_runs(
    src_ids: Sequence[int] | np.ndarray, dst_ids: Sequence[int] | np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group ``(src, dst)`` pairs into runs where both ids advance by one.

    Pairs are first ordered by source id (copies within one batch are
    independent, so order is free), then split wherever either side breaks.
    Returns ``(src_starts, dst_starts, lengths)`` as int64 arrays.
    """
    src = np.asarray(src_ids, dtype=np.int64)
    dst = np.asarray(dst_ids, dtype=np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"src and dst block lists differ in length: {src.shape} vs {dst.shape}")
    if src.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    order = np.argsort(src, kind="stable")
    src, dst = src[order], dst[order]
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [src.size]))
    return src[starts], dst[starts], ends - starts


@dataclass(frozen=True)
class CopyBatch:
    """Flat copy descriptors: copy ``sizes[k]`` bytes from ``src_ptrs[k]`` to ``dst_ptrs[k]``.

    The copies are independent (no two descriptors write the same byte), so a
    backend may run them in any order or in parallel.
    """

    src_ptrs: np.ndarray  # uint64
    dst_ptrs: np.ndarray  # uint64
    sizes: np.ndarray  # uint64

    def __len__(self) -> int:
        return int(self.sizes.size)

    @property
    def num_bytes(self) -> int:
        return int(self.sizes.sum()) if self.sizes.size else 0


def _check_ids(ids: np.ndarray, regions: Sequence[BlockRegion], side: str) -> None:
    if ids.size == 0:
        return
    limit = min(r.num_blocks for r in regions)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= limit:
        raise ValueError(f"{side} block id out of range [0, {limit}): min {lo}, max {hi}")


def build_copy_batch(
    src_regions: Sequence[BlockRegion],
    dst_regions: Sequence[BlockRegion],
    src_ids: Sequence[int] | np.ndarray,
    dst_ids: Sequence[int] | np.ndarray,
) -> CopyBatch:
    """Descriptors copying block ``src_ids[k]`` to block ``dst_ids[k]`` in every region pair.

    Region ``i`` of ``src_regions`` is copied into region ``i`` of ``dst_regions``;
    paired regions must have equal ``block_bytes``. Out-of-range ids and
    duplicate destinations raise ``ValueError`` (either would corrupt memory).
    """
    if len(src_regions) != len(dst_regions):
        raise ValueError(f"{len(src_regions)} source regions vs {len(dst_regions)} destination")
    for s, d in zip(src_regions, dst_regions):
        if s.block_bytes != d.block_bytes:
            raise ValueError(f"paired regions differ in block size: {s} vs {d}")
    src = np.asarray(src_ids, dtype=np.int64)
    dst = np.asarray(dst_ids, dtype=np.int64)
    _check_ids(src, src_regions, "source")
    _check_ids(dst, dst_regions, "destination")
    if np.unique(dst).size != dst.size:
        raise ValueError("a destination block appears twice in one batch")

    merged = merge_runs(src, dst)
    single = None  # lazily built one-block runs for non-contiguous regions
    src_parts, dst_parts, size_parts = [], [], []
    for s, d in zip(src_regions, dst_regions):
        if s.contiguous and d.contiguous:
            s_start, d_start, length = merged
        else:
            if single is None:
                order = np.argsort(src, kind="stable")
                single = (src[order], dst[order], np.ones(src.size, dtype=np.int64))
            s_start, d_start, length = single
        src_parts.append(s.base_ptr + s_start * s.block_stride_bytes)
        dst_parts.append(d.base_ptr + d_start * d.block_stride_bytes)
        size_parts.append(length * s.block_bytes)
    if not src_parts:
        empty = np.empty(0, dtype=np.uint64)
        return CopyBatch(empty, empty, empty)
    return CopyBatch(
        np.concatenate(src_parts).astype(np.uint64),
        np.concatenate(dst_parts).astype(np.uint64),
        np.concatenate(size_parts).astype(np.uint64),
    )

