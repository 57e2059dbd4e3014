"""What makes a stored KV block valid: one fingerprint for every tier that keeps blocks.

A block's key is vLLM's block hash, which names the tokens only: the same
tokens give the same key under any model (and in any process whose block
hashes have the same seed: :func:`block_hash_seed_is_random`). So a tier
stores each block with the key *and* a fingerprint of everything else its
bytes depend on, and a read checks both:

* the model (path or name, revision, quantization), a digest of its weights
  (:mod:`~kvoffload_hal.tiers.weights_digest`) and its dtype;
* the KV cache: dtype, block size, the layout of every KV tensor (its
  dtype, its shape without the block count, the order of its strides) and
  the KV cache groups (kind, block size, layers of each);
* the parallel layout: TP and PP sizes and this worker's rank within its
  replica (each rank holds its own shard; the ranks of different data-parallel
  replicas that hold the same shard compute the same bytes, so the
  data-parallel rank is not part of it: :func:`rank_in_replica`);
* vLLM's block-hash function and its seed (``PYTHONHASHSEED``).

A mismatch is a miss, recomputed like any other.

vLLM derives the hash of a request's first block from a seed, ``NONE_HASH``:
with ``PYTHONHASHSEED`` set, from its value; unset, vLLM 0.23 draws 32 random
bytes per process, whatever the hash algorithm, and vLLM 0.32 uses a fixed
seed for ``sha256``/``sha256_cbor`` (the default) and a random one for
``xxhash``/``xxhash_cbor``. A random seed gives every process other block
hashes, so blocks kept across a restart are never found again:
:func:`restart_warning` says so at start-up.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvoffload_hal.tiers.weights_digest import weights_digest

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


def rank_in_replica(world_rank: int, ranks_per_replica: int) -> int:
    """The rank of a worker within its data-parallel replica (its TP x PP position).

    vLLM numbers the workers of data-parallel replicas that run in lockstep (MoE
    models) across replicas: rank ``dp_rank * (TP x PP) + local``. Two replicas'
    workers at the same position hold the same shard of the same KV, and must
    share their blocks; the TP and PP position stays in the fingerprint, since
    it names which shard the bytes are.
    """
    return world_rank % max(1, ranks_per_replica)


def kv_fingerprint(vllm_config: VllmConfig, kv_tensors: Sequence[torch.Tensor],
                   num_blocks: int, rank: int, kv_cache_config: Any = None) -> bytes:
    """:data:`FINGERPRINT_BYTES` bytes naming what this worker's KV bytes depend on."""
    from kvoffload_hal import vllm_compat  # vLLM at call time, not at import

    model, cache = vllm_config.model_config, vllm_config.cache_config
    parallel = vllm_config.parallel_config
    fields: dict[str, Any] = {
        "model": model.model,
        "revision": model.revision,
        "weights": weights_digest(model, vllm_config.load_config.download_dir),
        "quantization": model.quantization,
        "dtype": str(model.dtype),
        "kv_cache_dtype": cache.cache_dtype,
        "block_size": cache.block_size,
        "layout": [kv_tensor_layout(t, num_blocks) for t in kv_tensors],
        "groups": None if kv_cache_config is None else kv_group_layout(kv_cache_config),
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "rank": rank,
        "hash_algo": vllm_compat.prefix_caching_hash_algo(vllm_config),
        "hash_seed": os.environ.get("PYTHONHASHSEED"),
    }
    encoded = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(encoded).digest()


def block_hash_seed_is_random(hash_algo: str | None = None) -> bool:
    """Whether vLLM seeds block hashing with ``hash_algo`` differently in every process.

    Asks vLLM's own seed resolution (``resolve_none_hash_seed``, vLLM 0.32)
    twice: a random seed differs between the two. A vLLM without it (0.23)
    draws a random seed whenever ``PYTHONHASHSEED`` is unset.
    """
    if os.environ.get("PYTHONHASHSEED") is not None:
        return False
    from kvoffload_hal import vllm_compat  # vLLM at call time, not at import

    return vllm_compat.hash_seed_is_random(hash_algo)


def restart_warning(kept: bool, path: str, hash_algo: str | None = None) -> str | None:
    """The one-line start-up warning for a tier whose blocks in ``path`` outlive the
    server (``kept``) while block hashes are seeded at random, else None."""
    if not kept or not block_hash_seed_is_random(hash_algo):
        return None
    return (f"kvoffload-hal: blocks kept in {path} cannot be found again after a restart: "
            f"vLLM seeds block hashes ({hash_algo or 'sha256'}) at random when PYTHONHASHSEED "
            "is unset; set PYTHONHASHSEED (any fixed value, the same for every restart)")
