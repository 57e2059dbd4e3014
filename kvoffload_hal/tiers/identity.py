"""What makes a stored KV block valid: one fingerprint for every tier that keeps blocks.

A block's key is vLLM's block hash, which names the tokens only: the same
tokens give the same key under any model (and, with ``PYTHONHASHSEED`` set,
in any process). So a tier stores each block with the key *and* a
fingerprint of everything else its bytes depend on, and a read checks both:

* the model (path or name, revision, quantization) and its dtype;
* the KV cache: dtype, block size, the layout of every KV tensor (its
  dtype, its shape without the block count, the order of its strides) and
  the KV cache groups (kind, block size, layers of each);
* the parallel layout: TP and PP sizes and this worker's rank (each rank
  holds its own shard);
* vLLM's block-hash function and its seed.

A mismatch is a miss, recomputed like any other.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig

FINGERPRINT_BYTES = 32


def kv_tensor_layout(tensor: torch.Tensor, num_blocks: int) -> tuple[str, tuple, tuple]:
    """A KV tensor's layout, independent of how many blocks this instance has."""
    shape = tuple(-1 if n == num_blocks else n for n in tensor.shape)
    stride_order = tuple(sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d)))
    return str(tensor.dtype), shape, stride_order


def kv_group_layout(kv_cache_config: Any) -> list[tuple[str, int, int]]:
    """Each KV cache group's kind, block size and layer count, in group order (the
    group id is part of every block key, so the order names what a key holds)."""
    return [(type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size, len(g.layer_names))
            for g in kv_cache_config.kv_cache_groups]


def kv_fingerprint(vllm_config: VllmConfig, kv_tensors: Sequence[torch.Tensor],
                   num_blocks: int, rank: int, kv_cache_config: Any = None) -> bytes:
    """:data:`FINGERPRINT_BYTES` bytes naming what this worker's KV bytes depend on."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    parallel = vllm_config.parallel_config
    fields: dict[str, Any] = {
        "model": getattr(model, "model", None),
        "revision": getattr(model, "revision", None),
        "quantization": getattr(model, "quantization", None),
        "dtype": str(getattr(model, "dtype", None)),
        "kv_cache_dtype": getattr(cache, "cache_dtype", None),
        "block_size": getattr(cache, "block_size", None),
        "layout": [kv_tensor_layout(t, num_blocks) for t in kv_tensors],
        "groups": None if kv_cache_config is None else kv_group_layout(kv_cache_config),
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "rank": rank,
        "hash_algo": getattr(cache, "prefix_caching_hash_algo", None),
        "hash_seed": os.environ.get("PYTHONHASHSEED"),
    }
    encoded = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(encoded).digest()
