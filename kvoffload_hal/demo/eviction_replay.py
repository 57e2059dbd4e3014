"""Replaying block access traces: the offline optimum, the CPU tier itself, vLLM's policies.

A trace is a list of requests, each the block keys of its prompt in order (a
key stands for a block hash: the same key is the same prefix block). Three
replays count *hit blocks*, a hit being the run of cached blocks from a
request's first block on (prefix caching serves nothing after a miss):

* :func:`belady_hits`: Belady's MIN with bypass, the offline optimum of a cache
  of ``capacity`` blocks. On a miss the block is stored only if some cached
  block's next use is later than its own, and that block is evicted. A block's
  next use is never earlier than its parent's (a request reads the parent
  first), so the optimum holds whole prefixes and its block hits are prefix hits.
* :func:`count_oracle_hits`: a cache told each block's reads left, not
  when: what knowing the access frequencies alone serves.
* :func:`replay_tier`: the real :class:`~kvoffload_hal.scheduler.cpu_tier.CpuTier`
  (vLLM's ``BlockPool`` and coordinator, and the eviction policy), driven as the
  scheduler drives it: find the hit, pin it, load it, store the misses in
  fresh blocks, publish, unpin. No model runs.
* :func:`replay_vllm_policy`: a ``CachePolicy`` of vLLM's own offloading
  connector (``LRU``, ``ARC``), where installed.

Pure Python, no device: a suite of traces replays in seconds.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from kvoffload_hal.scheduler.cpu_tier import CpuTier

Trace = Sequence[Sequence[int]]  # requests, each its block keys in prompt order
REPLAY_BLOCK_SIZE = 16  # tokens per block in a replayed tier: only the count matters
NEVER = 1 << 62


def belady_hits(trace: Trace, capacity: int, counted_from: int = 0) -> int:
    """Hit blocks of the offline optimum (MIN with bypass) on ``trace``, counted
    from its request ``counted_from`` on (those before only fill the cache)."""
    flat = [k for request in trace for k in request]
    next_use = [NEVER] * len(flat)
    last: dict[int, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        next_use[i] = last.get(flat[i], NEVER)
        last[flat[i]] = i
    cached: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key); stale entries skipped
    hits = 0
    i = 0
    for n, request in enumerate(trace):
        in_prefix = n >= counted_from
        for key in request:
            nxt = next_use[i]
            i += 1
            if key in cached:
                hits += in_prefix
            else:
                in_prefix = False
                if len(cached) >= capacity:
                    while heap and cached.get(heap[0][1]) != -heap[0][0]:
                        heapq.heappop(heap)
                    if not heap or -heap[0][0] <= nxt:
                        continue  # every cached block is needed before this one
                    del cached[heapq.heappop(heap)[1]]
            cached[key] = nxt
            heapq.heappush(heap, (-nxt, key))
    return hits


def count_oracle_hits(trace: Trace, capacity: int, counted_from: int = 0) -> int:
    """Hit blocks, counted as :func:`belady_hits` counts them, of a cache told how
    many more times each block will be read but not when: it evicts the block
    with the fewest reads left (the least recent of those), and bypasses a
    block with no more reads left than that one. What a policy that knew every
    block's future *frequency*, the most an access pattern can tell it, would
    serve: where the order of the reads is random, the gap from Belady's optimum
    is the part no online policy closes."""
    left: dict[int, int] = {}
    for request in trace:
        for key in request:
            left[key] = left.get(key, 0) + 1
    cached: dict[int, tuple[int, int]] = {}  # key -> (reads left, last access)
    heap: list[tuple[int, int, int]] = []  # (reads left, last access, key); stale skipped
    hits = 0
    now = 0
    for n, request in enumerate(trace):
        in_prefix = n >= counted_from
        for key in request:
            now += 1
            left[key] -= 1
            if key in cached:
                hits += in_prefix
            else:
                in_prefix = False
                if len(cached) >= capacity:
                    while heap and cached.get(heap[0][2]) != heap[0][:2]:
                        heapq.heappop(heap)
                    if not heap or heap[0][0] >= left[key]:
                        continue  # no cached block has fewer reads left
                    del cached[heapq.heappop(heap)[2]]
            cached[key] = (left[key], now)
            heapq.heappush(heap, (left[key], now, key))
    return hits


class KeyHashes:
    """Block hashes of trace keys: 32-byte digests, as vLLM's sha256 hashes are."""

    def __init__(self) -> None:
        self._hashes: dict[int, bytes] = {}

    def __call__(self, key: int) -> bytes:
        h = self._hashes.get(key)
        if h is None:
            h = self._hashes[key] = hashlib.sha256(key.to_bytes(8, "little")).digest()
        return h


def make_replay_tier(num_blocks: int, eviction: str) -> CpuTier:
    """A CPU tier that caches ``num_blocks`` blocks of one full-attention layer, no engine.

    The pool gets one more block: vLLM's ``BlockPool`` keeps block 0 as its null block.
    """
    num_blocks += 1
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=REPLAY_BLOCK_SIZE, num_kv_heads=1, head_size=64,
                             dtype=torch.float16)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    # Only these fields of a VllmConfig reach the coordinator's factory.
    vllm_config = SimpleNamespace(
        kv_events_config=None,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
        model_config=SimpleNamespace(max_model_len=1 << 20),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    return CpuTier(vllm_config, config, num_blocks, REPLAY_BLOCK_SIZE, REPLAY_BLOCK_SIZE,
                   eviction=eviction)


def replay_tier(tier: CpuTier, trace: Trace, hashes: KeyHashes | None = None) -> int:
    """Hit blocks of ``tier`` on ``trace``, driven as the scheduler drives it."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    hashes = hashes or KeyHashes()
    hits = 0
    for request in trace:
        block_hashes = [hashes(k) for k in request]
        hit, tokens = tier.find_hit(block_hashes, 0, len(request) * tier.block_size)
        num_hit = tokens // tier.block_size
        hits += num_hit
        tier.pin_hit(hit)  # held while the misses are stored, as a load holds it
        if num_hit:
            tier.record_load([b.block_id for b in hit[0]])
        num_new = min(len(request) - num_hit, tier.num_free_blocks())
        if num_new > 0:
            blocks = tier.allocate(num_new)
            tier.publish(blocks, [make_block_hash_with_group_id(h, 0)
                                  for h in block_hashes[num_hit:num_hit + num_new]])
            tier.unpin(blocks)
        tier.unpin_hit(hit)
    return hits


def vllm_policy_class(name: str) -> Any:
    """vLLM's offloading ``CachePolicy`` called ``name`` (``lru``, ``arc``)."""
    from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
    from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

    return LRUCachePolicy if name == "lru" else ARCCachePolicy


def replay_vllm_policy(policy_cls: Any, trace: Trace, capacity: int) -> int:
    """Hit blocks of one of vLLM's offloading policies on ``trace``.

    Driven as its ``CPUOffloadingManager`` drives it: a lookup walks the keys
    while cached, the hit is touched, then room is made for the misses (the
    request's own keys protected) and they are inserted, ready.
    """
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

    policy = policy_cls(capacity)
    context = ReqContext(req_id="replay")
    hits = 0
    used = 0
    for request in trace:
        keys = [k.to_bytes(8, "little") for k in request]
        num_hit = 0
        while num_hit < len(keys) and policy.get(keys[num_hit]) is not None:
            num_hit += 1
        hits += num_hit
        misses = keys[num_hit:]
        policy.touch(keys[:num_hit], context)
        policy.on_store_miss(misses, context)
        over = used + len(misses) - capacity
        if over > 0:
            evicted = policy.evict(over, set(keys))
            if evicted is None:  # the request alone is larger than the cache
                misses = misses[:len(misses) - over]
            else:
                used -= len(evicted)
        for key in misses:
            chunk = ChunkStatus(used)
            chunk.ref_cnt = 0  # stored and ready
            policy.insert(key, chunk)
            policy.mark_evictable(key)  # its store completed
            used += 1
    return hits


def recorded_trace_hits(recorded: Sequence[tuple[Any, bool]], capacity: int) -> dict[str, int]:
    """Hit blocks on a trace a running tier recorded (``Eviction.trace``): the
    tier's own, and Belady's, LRU's and vLLM's policies' on the same accesses.

    The recording is a stream of blocks without request boundaries, so the
    replays are per block (each block a request of one): an upper bound for
    prefix hits in the optimum's case, plain key-level caches for the others.
    """
    ids: dict[Any, int] = {}
    trace = [[ids.setdefault(key, len(ids))] for key, _ in recorded]
    hits = {"tier": sum(1 for _, hit in recorded if hit),
            "belady": belady_hits(trace, capacity),
            "counts": count_oracle_hits(trace, capacity),
            "lru": replay_tier(make_replay_tier(capacity, "lru"), trace)}
    for name in ("lru", "arc"):
        hits[f"vllm-{name}"] = replay_vllm_policy(vllm_policy_class(name), trace, capacity)
    return hits
