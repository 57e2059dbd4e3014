"""Per-layer KV cache entries -> the block regions a copy backend is bound to.

vLLM hands the connector one tensor per layer. vllm-ascend hands a tuple or a
list per layer: dense attention ``(k, v)``, MLA ``(nope, rope)``, sparse DSA
``(k, v, indexer[, indexer_scale])`` (the indexer with ``num_blocks *
replicated_size`` rows, its scale sharing the indexer's allocation), Mamba
state lists ``[conv, ssm]`` sliced one after the other from one allocation,
and compressed caches as ``as_strided`` views of one per-block page, the
last of which may cover the others (A5). Layers of different KV cache groups
may view one allocation, each by its own spec.

:func:`describe_kv_caches` turns all of that into regions such that each byte
of a block is copied exactly once:

1. every entry is named ``layer`` (a tensor) or ``layer[i]`` (a sequence) and
   described from its shape and strides (``describe_kv_tensor``);
2. regions whose spans intersect (views of one memory) and share a block
   stride are merged: the bytes of one block, over all those views, become
   one region per contiguous piece, so the host holds each device byte of a
   block once and host bytes per block equal distinct device bytes per block;
3. anything else is refused with one line naming the layers and the layout:
   a tensor no block dimension fits, views of one memory whose bytes of one
   block reach into another block's, and views of one memory with different
   block strides that share bytes. vllm-ascend's hybrid attention + Mamba
   tensor (states over all blocks, then K and V over all blocks) is not such a
   case as vllm-ascend sizes it: a block's K page equals its SSM state, so each
   block id owns three disjoint stripes, merged per step 2. It becomes one when
   ``--block-size`` is set above the derived size (K = 2 x SSM): refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvoffload_hal.hal.regions import BlockRegion, describe_kv_tensor
from kvoffload_hal.logger import init_logger

__all__ = ["NamedRegion", "describe_kv_caches", "flatten_kv_caches", "merge_shared_regions"]

logger = init_logger(__name__)

KvCacheEntry = torch.Tensor | Sequence[torch.Tensor]
DescribeFn = Callable[[torch.Tensor, int], list[BlockRegion]]


@dataclass(frozen=True)
class NamedRegion:
    """A region and the KV cache entries (``layer`` or ``layer[i]``) it holds bytes of."""

    names: tuple[str, ...]
    region: BlockRegion


def flatten_kv_caches(kv_caches: Mapping[str, KvCacheEntry]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of every layer, in order; empty tensors dropped."""
    out = []
    for layer, value in kv_caches.items():
        if isinstance(value, torch.Tensor):
            entries = [(layer, value)]
        elif isinstance(value, (list, tuple)):
            entries = [(f"{layer}[{i}]", t) for i, t in enumerate(value)]
        else:
            raise TypeError(f"KV cache of layer {layer!r} is a {type(value).__name__}; "
                            "expected a tensor or a list/tuple of tensors")
        for name, t in entries:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"KV cache {name!r} is a {type(t).__name__}; expected a tensor")
            if t.numel() > 0:
                out.append((name, t))
    return out


def describe_kv_caches(kv_caches: Mapping[str, KvCacheEntry], num_blocks: int,
                       describe: DescribeFn = describe_kv_tensor) -> list[BlockRegion]:
    """The regions of every layer's KV cache, views of one memory merged; see the module."""
    named = []
    for name, t in flatten_kv_caches(kv_caches):
        try:
            regions = describe(t, num_blocks)
        except ValueError as exc:
            raise ValueError(f"KV cache {name!r} ({t.dtype}): {exc}") from None
        named.extend(NamedRegion((name,), r) for r in regions)
    merged = merge_shared_regions(named)
    if len(merged) < len(named):
        logger.debug("KV caches: %d regions merged into %d (views of shared memory)",
                     len(named), len(merged))
    return [m.region for m in merged]


def merge_shared_regions(named: Sequence[NamedRegion]) -> list[NamedRegion]:
    """Merge regions viewing one memory; raise ``ValueError`` where blocks would mix."""
    out: list[NamedRegion] = []
    for cluster in _span_clusters(named):
        by_stride: dict[int, list[NamedRegion]] = {}
        for n in cluster:
            by_stride.setdefault(n.region.block_stride_bytes, []).append(n)
        merged = [m for group in by_stride.values()
                  for sub in _span_clusters(group) for m in _merge_same_stride(sub)]
        if len(by_stride) > 1:
            _check_disjoint(merged)
        out.extend(merged)
    return out


def _span_clusters(items: Sequence[NamedRegion]) -> list[list[NamedRegion]]:
    """Items grouped by intersecting spans, in order of first appearance."""
    order = sorted(range(len(items)), key=lambda i: items[i].region.base_ptr)
    clusters: list[list[int]] = []
    end = 0
    for i in order:
        r = items[i].region
        if clusters and r.base_ptr < end:
            clusters[-1].append(i)
            end = max(end, r.base_ptr + r.span_bytes)
        else:
            clusters.append([i])
            end = r.base_ptr + r.span_bytes
    clusters.sort(key=min)
    return [[items[i] for i in sorted(c)] for c in clusters]


def _merge_same_stride(group: Sequence[NamedRegion]) -> list[NamedRegion]:
    """One region per contiguous piece of the union of one block's bytes over ``group``."""
    if len(group) == 1:
        return list(group)
    first = group[0].region
    names = _names(group)
    if any(n.region.num_blocks != first.num_blocks for n in group):
        raise ValueError(f"KV caches {names} view one memory with different block counts "
                         f"{sorted({n.region.num_blocks for n in group})}; expected one count")
    base = min(n.region.base_ptr for n in group)
    pieces = sorted((n.region.base_ptr - base, n.region.block_bytes, n.names) for n in group)
    spans: list[tuple[int, int, tuple[str, ...]]] = []
    for offset, size, owners in pieces:
        if spans and offset <= spans[-1][1]:
            start, end, held = spans[-1]
            spans[-1] = (start, max(end, offset + size), held + owners)
        else:
            spans.append((offset, offset + size, owners))
    stride, extent = first.block_stride_bytes, spans[-1][1]
    if first.num_blocks > 1 and extent > stride:
        raise ValueError(
            f"KV caches {names} view one memory with a block stride of {stride} B, but their "
            f"bytes of one block span {extent} B (offsets {[p[0] for p in pieces]}), so one "
            f"block's bytes reach into another block's; expected every view of one memory to "
            f"keep a block's bytes within one block stride")
    return [NamedRegion(tuple(dict.fromkeys(held)),
                        BlockRegion(base + start, first.num_blocks, end - start, stride))
            for start, end, held in spans]


def _check_disjoint(regions: Sequence[NamedRegion]) -> None:
    """Raise unless no byte of any block of one region is a byte of another region."""
    origin = min(n.region.base_ptr for n in regions)
    starts, ends, owner = [], [], []
    for k, n in enumerate(regions):
        r = n.region
        s = (r.base_ptr - origin) + np.arange(r.num_blocks, dtype=np.int64) * r.block_stride_bytes
        starts.append(s)
        ends.append(s + r.block_bytes)
        owner.append(np.full(r.num_blocks, k, dtype=np.int64))
    start, end, who = (np.concatenate(a) for a in (starts, ends, owner))
    order = np.argsort(start, kind="stable")
    start, end, who = start[order], end[order], who[order]
    reach = np.maximum.accumulate(end)
    clash = np.flatnonzero(start[1:] < reach[:-1])
    if clash.size == 0:
        return
    k = int(clash[0]) + 1
    other = regions[int(who[int(np.flatnonzero(end[:k] == reach[k - 1])[-1])])]
    this = regions[int(who[k])]
    raise ValueError(
        f"KV caches {list(other.names)} (block stride {other.region.block_stride_bytes} B) "
        f"and {list(this.names)} (block stride {this.region.block_stride_bytes} B) view "
        f"overlapping memory, so a block of one holds bytes of other blocks of the other; "
        f"expected views of one memory to share a block stride (vllm-ascend lays a hybrid "
        f"attention + Mamba tensor out so only when --block-size is set above the block "
        f"size it derives for the model: leave --block-size unset)")


def _names(items: Sequence[NamedRegion]) -> list[str]:
    return list(dict.fromkeys(name for n in items for name in n.names))
