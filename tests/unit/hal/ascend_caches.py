"""KV caches built as vllm-ascend 0.23's ``NPUModelRunner`` builds them, on CPU tensors.

Shapes, strides, dtypes and the 2 MiB alignment follow
``vllm_ascend/worker/model_runner_v1.py`` (``_allocate_kv_cache_tensors``,
``_allocate_int8_cache_tensor``, ``_align_memory``,
``_allocate_sparse_c8_indexer_tensors``, ``_adjust_kv_layout``,
``_reshape_kv_cache_tensors``): every cache starts as an int8 buffer of
``numel + 2 MiB`` whose aligned start is sliced to ``numel`` bytes, then is
viewed in its dtype and shape. Each builder also records, per tensor, how many
rows of dimension 0 one block owns (vLLM maps block ``b`` to kernel blocks
``[b * k, (b + 1) * k)``; vllm-ascend's replicated indexer maps it to rows
``[b * R, (b + 1) * R)``), which is what the round-trip checks go by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

ALIGN = 2 << 20  # NPUModelRunner aligns KV caches to 2 MiB when a KV connector is set


def int8_cache(numel: int) -> torch.Tensor:
    """``_allocate_int8_cache_tensor``: ``numel + ALIGN`` bytes, sliced to an aligned start."""
    raw = torch.zeros(numel + ALIGN, dtype=torch.int8)
    return raw[-raw.data_ptr() % ALIGN:][:numel]


def view_as(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return raw.view(dtype).view(shape)


@dataclass
class Caches:
    """``kv_caches`` as handed to ``register_kv_caches`` and the rows per block of each tensor."""

    num_blocks: int
    kv_caches: dict[str, object] = field(default_factory=dict)
    rows: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def add(self, layer: str, value, rows: tuple[int, ...] | int = 1) -> None:
        n = 1 if isinstance(value, torch.Tensor) else len(value)
        self.kv_caches[layer] = value
        self.rows[layer] = rows if isinstance(rows, tuple) else (rows,) * n

    def entries(self) -> list[tuple[torch.Tensor, int]]:
        out = []
        for layer, value in self.kv_caches.items():
            tensors = [value] if isinstance(value, torch.Tensor) else list(value)
            out.extend(zip(tensors, self.rows[layer]))
        return out


def dense(c: Caches, layer: str, block_size=16, heads=2, head_dim=8, kernel_block=None,
          dtype=torch.bfloat16) -> None:
    """Dense attention ``(k, v)``, separate allocations; with ``kernel_block`` the hybrid
    kernel-block shape ``(num_blocks * (block_size // kernel_block), kernel_block, ...)``."""
    rows = block_size // kernel_block if kernel_block else 1
    shape = (c.num_blocks * rows, block_size // rows, heads, head_dim)
    numel = math.prod(shape) * dtype.itemsize
    c.add(layer, (view_as(int8_cache(numel), dtype, shape),
                  view_as(int8_cache(numel), dtype, shape)), rows)


def mla(c: Caches, layer: str, block_size=16, kv_lora_rank=32, rope_dim=8,
        dtype=torch.bfloat16) -> None:
    """MLA ``(nope, rope)``: ``[num_blocks, block_size, 1, dim]`` each, separate allocations."""
    caches = []
    for dim in (kv_lora_rank, rope_dim):
        shape = (c.num_blocks, block_size, 1, dim)
        caches.append(view_as(int8_cache(math.prod(shape) * dtype.itemsize), dtype, shape))
    c.add(layer, tuple(caches))


def sparse_dsa(c: Caches, layer: str, replicated=2, li_c8=False, sfa_c8=False, block_size=16,
               k_dim=32, rope_dim=8, index_dim=16, kernel_block=None) -> None:
    """Sparse DSA: ``(k, v, dsa_k[, dsa_k_scale])`` or, with SFA C8, ``(k, dsa_k[, scale])``.

    The indexer has ``num_blocks * replicated`` rows; with LI C8 its int8 keys and
    float16 scales share one aligned allocation, the scales at the next 2-byte offset.
    ``kernel_block`` splits k/v rows as the hybrid-block path does (the indexer keeps
    ``block_size`` rows)."""
    n, chunk = c.num_blocks, (block_size // kernel_block if kernel_block else 1)
    kv_dtype = torch.int8 if sfa_c8 else torch.bfloat16
    tensors, rows = [], []
    for dim in (k_dim,) if sfa_c8 else (k_dim, rope_dim):
        shape = (n * chunk, block_size // chunk, 1, dim)
        tensors.append(view_as(int8_cache(math.prod(shape) * kv_dtype.itemsize), kv_dtype, shape))
        rows.append(chunk)
    index_shape = (n * replicated, block_size, 1, index_dim)
    if li_c8:
        scale_shape = index_shape[:3] + (1,)
        k_bytes, scale_bytes = math.prod(index_shape), math.prod(scale_shape) * 2
        scale_offset = -(-k_bytes // 2) * 2
        raw = int8_cache(scale_offset + scale_bytes)
        tensors += [view_as(raw[:k_bytes], torch.int8, index_shape),
                    view_as(raw[scale_offset:scale_offset + scale_bytes], torch.float16,
                            scale_shape)]
        rows += [replicated, replicated]
    else:
        tensors.append(view_as(int8_cache(math.prod(index_shape) * 2), torch.bfloat16,
                               index_shape))
        rows.append(replicated)
    c.add(layer, tuple(tensors), tuple(rows))


def mamba(c: Caches, layer: str, conv_shape=(3, 24), ssm_shape=(2, 8, 8),
          page_padding=64, raw: torch.Tensor | None = None) -> torch.Tensor:
    """Mamba state list ``[conv, ssm]`` sliced one after the other from one raw tensor of
    ``num_blocks`` padded pages; returns that raw tensor."""
    conv_bytes = math.prod(conv_shape) * 2  # bfloat16
    ssm_bytes = math.prod(ssm_shape) * 4  # float32
    if raw is None:
        raw = int8_cache(c.num_blocks * (conv_bytes + ssm_bytes + page_padding))
    n = c.num_blocks
    conv = view_as(raw[:n * conv_bytes], torch.bfloat16, (n, *conv_shape))
    ssm = view_as(raw[n * conv_bytes:n * (conv_bytes + ssm_bytes)], torch.float32,
                  (n, *ssm_shape))
    c.add(layer, [conv, ssm])
    return raw


def compressed(c: Caches, layer: str, a5: bool, block_size=16, head_dim=128,
               raw: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek-V4 compressed cache (``_adjust_kv_layout``): per-block pages of one raw
    tensor viewed as keys ``[n, bs, 1, head_dim]`` (1-byte dtype) then scales
    ``[n, bs, 1, 1]``; on A5 the scales are float32 and a third view, keys and scales
    as one ``[n, bs, 1, head_dim + 4]`` int8 row, covers both."""
    scale_dtype = torch.float32 if a5 else torch.float16
    page = block_size * (head_dim + scale_dtype.itemsize)
    if raw is None:
        raw = int8_cache(c.num_blocks * page)
    shapes = [((c.num_blocks, block_size, 1, head_dim), torch.int8),
              ((c.num_blocks, block_size, 1, 1), scale_dtype)]
    if a5:
        shapes.append(((c.num_blocks, block_size, 1, head_dim + scale_dtype.itemsize),
                       torch.int8))
    views, offset = [], raw.storage_offset()
    for i, (shape, dtype) in enumerate(shapes):
        if i == 2:
            offset = raw.storage_offset()  # the full view restarts at the page's start
        inner = torch.empty(shape).stride()[1:]
        views.append(torch.as_strided(raw.view(dtype), shape, (page // dtype.itemsize, *inner),
                                      offset // dtype.itemsize))
        offset += math.prod(shape[1:]) * dtype.itemsize
    c.add(layer, views)
    return raw


def hybrid_attention_mamba(c: Caches, attn_layer: str, mamba_layer: str, block_size=16,
                           kernel_block=8, heads=1, head_dim=16, conv_shape=(3, 64),
                           ssm_shape=(2, 8, 8)) -> dict[str, int]:
    """One raw tensor shared by a Mamba layer and an attention layer, as vllm-ascend
    0.23.0.post1 builds it (``model_runner_v1.py``, ``patch_mamba_config.py``).

    The Mamba states lie one after the other over all blocks (conv, then ssm); the
    attention K then V lie over all blocks at the end, after a padding of
    ``raw - 2 x K`` bytes. vllm-ascend derives the attention block size so that a
    block's K page equals its SSM state (S == K) and the page is conv + 2K, so block
    ``b`` owns three stripes: conv ``[bC, +C)``, K / ssm ``[nC + bK, +K)`` and V
    ``[nC + nK + bK, +K)``; no two block ids share a byte. A ``block_size`` above
    the derived one (a user's ``--block-size``) breaks S == K, and then block ids
    do share bytes. Returns the geometry (C, S, K, page) in bytes.
    """
    conv = math.prod(conv_shape) * 2  # bfloat16
    ssm = math.prod(ssm_shape) * 4  # float32
    k_page = block_size * heads * head_dim * 2  # bfloat16
    page = conv + 2 * k_page
    n = c.num_blocks
    raw = int8_cache(n * page)
    mamba(c, mamba_layer, conv_shape, ssm_shape, raw=raw)
    chunk = block_size // kernel_block
    shape = (n * chunk, kernel_block, heads, head_dim)
    k_bytes = math.prod(shape) * 2
    kv = raw[raw.numel() - 2 * k_bytes:]  # after the padding (n x C when S == K)
    c.add(attn_layer, (view_as(kv[:k_bytes], torch.bfloat16, shape),
                       view_as(kv[k_bytes:], torch.bfloat16, shape)), chunk)
    return {"conv": conv, "ssm": ssm, "k": k_page, "page": page}
