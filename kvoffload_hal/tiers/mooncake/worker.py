"""Mooncake Store secondary tier: CPU-tier blocks in a store every instance shares.

**Keys.** ``kvhal/<fingerprint>/<block key>``: the block key is vLLM's block
hash (the tokens and everything before them); the fingerprint
(:func:`~kvoffload_hal.tiers.identity.kv_fingerprint`) names the model,
revision, dtypes, KV layout, block size, TP/PP sizes, this rank and the
block-hash function and seed. Instances of another model or layout, or other
ranks, use other keys: they never see each other's blocks.

**Values.** One block value (:mod:`~kvoffload_hal.tiers.block_value`): a
header, the key, then the block's bytes in every host region. Every read
checks all of it: a missing or evicted object, one of
another size (half-written), another key or fingerprint, or a wrong checksum
fails that key, which is recomputed; a value that fails its check is removed
from the store.

**Zero copy.** The CPU tier's host buffer and a header area (one slot per
CPU block) are registered with the client once; puts and gets move each
block straight between the store and its host regions with
``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``, a batch
per call. Existence queries are ``batch_is_exist``.

**Never on the engine thread.** Every client call runs on a small thread
pool; :meth:`poll` only collects finished calls. The scheduler bounds how
long a request waits for a query or a read (``mooncake_timeout_s``) and
recomputes after that; the CPU blocks of a read it stopped waiting for stay
referenced until the read really ends, so a late read never lands in a
reused block.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvoffload_hal.logger import init_logger, log_once
from kvoffload_hal.tiers.block_value import HEADER, BlockValueFormat
from kvoffload_hal.tiers.mooncake.client import (
    MooncakeUnavailable,
    connect,
    refuse_or_warn,
    register,
    tier_available,
)
from kvoffload_hal.tiers.spec import BlockKey, SecondaryTier, TierItem, TierJobResult
from kvoffload_hal.tiers.worker_pool import PooledTier

if TYPE_CHECKING:
    from kvoffload_hal.tiers.mooncake.config import MooncakeConfig

logger = init_logger(__name__)

MAGIC = b"KVHALMC1"
FORMAT_VERSION = 1
# One registered slot per CPU block holds its header and key; block keys are
# hex of vLLM's block hash with a group id (about 72 characters).
HEADER_SLOT_BYTES = 256
MAX_KEY_BYTES = HEADER_SLOT_BYTES - HEADER.size


class MooncakeTier(PooledTier):
    name = "mooncake"
    label = "Mooncake tier"
    batch_items = 64  # keys per client call: one RPC round trip carries many blocks

    def __init__(self, client: Any, host_chunks: Sequence[torch.Tensor],
                 host_views: Sequence[torch.Tensor], fingerprint: bytes) -> None:
        """``host_chunks``: the CPU tier's host buffers, each registered with the
        client; ``host_views``: one uint8 ``[num_cpu_blocks, block_bytes]`` view per
        host region, inside them; ``fingerprint``: what the bytes depend on."""
        self.client = client
        self.views = list(host_views)
        self.format = BlockValueFormat(MAGIC, FORMAT_VERSION, fingerprint,
                                       sum(v.shape[1] for v in self.views))
        self.prefix = f"kvhal/{fingerprint.hex()}/"
        num_blocks = self.views[0].shape[0]
        self._headers = torch.zeros(num_blocks, HEADER_SLOT_BYTES, dtype=torch.uint8)
        self._registered = [c.data_ptr() for c in host_chunks] + [self._headers.data_ptr()]
        for chunk in host_chunks:
            register(client, chunk.data_ptr(), chunk.numel(), "CPU tier's host memory")
        register(client, self._headers.data_ptr(), self._headers.numel(), "header area")
        super().__init__()

    # ------------------------------------------------------- PooledTier hooks
    # evict: nothing to delete, other instances may read these objects; the
    # master evicts by itself when the pool is full.

    def _store_batch(self, items: list[TierItem]) -> list[BlockKey]:
        return self._put_batch(items)

    def _load_batch(self, items: list[TierItem]) -> list[BlockKey]:
        return self._get_batch(items)

    def _probe_batch(self, items: list[TierItem]) -> list[BlockKey]:
        return self._exist_batch(items)

    def _close(self, idle: bool) -> None:
        if not idle:
            return  # a call still runs: the client and its buffers stay
        for ptr in self._registered:
            self.client.unregister_buffer(ptr)
        self.client.close()

    # ----------------------------------------------------------- the calls
    def store_key(self, key: BlockKey) -> str:
        return self.prefix + key

    def _buffers(self, items: list[TierItem]) -> tuple[list[list[int]], list[list[int]]]:
        ptrs, sizes = [], []
        for key, block in items:
            ptrs.append([self._headers[block].data_ptr()]
                        + [v[block].data_ptr() for v in self.views])
            sizes.append([HEADER.size + len(key)] + [v.shape[1] for v in self.views])
        return ptrs, sizes

    def _put_batch(self, items: list[TierItem]) -> list[BlockKey]:
        for key, block in items:
            self._write_header(key, block)
        ptrs, sizes = self._buffers(items)
        codes = self.client.batch_put_from_multi_buffers(
            [self.store_key(k) for k, _ in items], ptrs, sizes)
        return [k for (k, _), code in zip(items, codes) if code != 0]

    def _get_batch(self, items: list[TierItem]) -> list[BlockKey]:
        ptrs, sizes = self._buffers(items)
        codes = self.client.batch_get_into_multi_buffers(
            [self.store_key(k) for k, _ in items], ptrs, sizes)
        failed = []
        for (key, block), code, size in zip(items, codes, sizes):
            why = (f"read failed (code {code})" if code < 0
                   else f"{code} bytes, expected {sum(size)}" if code != sum(size)
                   else self._check(key, block))
            if why is not None:
                failed.append(self._unusable(key, why, remove=code >= 0))
        return failed

    def _exist_batch(self, items: list[TierItem]) -> list[BlockKey]:
        answers = self.client.batch_is_exist([self.store_key(k) for k, _ in items])
        return [k for (k, _), present in zip(items, answers) if present != 1]

    # ------------------------------------------------------------ values
    def _payload(self, block: int) -> list[np.ndarray]:
        return [view[block].numpy() for view in self.views]

    def _write_header(self, key: BlockKey, block: int) -> None:
        key_bytes = key.encode("ascii")
        if len(key_bytes) > MAX_KEY_BYTES:
            raise ValueError(f"block key of {len(key_bytes)} bytes, at most {MAX_KEY_BYTES}")
        header = self.format.header(key_bytes, self._payload(block))
        slot = self._headers[block].numpy()
        slot[:HEADER.size] = np.frombuffer(header, dtype=np.uint8)
        slot[HEADER.size:HEADER.size + len(key_bytes)] = np.frombuffer(key_bytes, dtype=np.uint8)

    def _check(self, key: BlockKey, block: int) -> str | None:
        """Why the value just read into ``block`` is unusable, or None when it is sound."""
        slot = self._headers[block].numpy().tobytes()
        key_len, _ = self.format.lengths(slot)
        return self.format.problem(slot[:HEADER.size], slot[HEADER.size:HEADER.size + key_len],
                                   key.encode("ascii"), self._payload(block))

    def _unusable(self, key: BlockKey, why: str, remove: bool) -> BlockKey:
        log_once(logger, logging.WARNING, "Mooncake tier: a block is unusable (%s); such "
                 "blocks are recomputed", why.split(" (")[0])
        logger.debug("Mooncake tier: block %s is unusable: %s", key, why)
        if remove:  # a value that fails its check would fail every instance's read
            self.client.remove(self.store_key(key), True)
        return key


class UnavailableTier(SecondaryTier):
    """A Mooncake tier that could not start in this worker: every job fails at
    once (its blocks are recomputed), every existence query answers "missing"."""

    name = "mooncake-unavailable"

    def __init__(self) -> None:
        self._results: list[TierJobResult] = []

    def submit_store(self, job_id: int, items: Sequence[TierItem]) -> None:
        self._results.append(TierJobResult(job_id, tuple(k for k, _ in items)))

    submit_load = submit_store

    def submit_probe(self, job_id: int, keys: Sequence[BlockKey]) -> None:
        self._results.append(TierJobResult(job_id, tuple(keys)))

    def poll(self) -> list[TierJobResult]:
        results, self._results = self._results, []
        return results

    def evict(self, keys: Iterable[BlockKey]) -> None:
        pass


def open_mooncake_tier(cfg: MooncakeConfig, host_chunks: Sequence[torch.Tensor],
                       host_views: Sequence[torch.Tensor], fingerprint: bytes) -> SecondaryTier:
    """The worker's Mooncake tier, or an :class:`UnavailableTier` (with one warning)
    when the master cannot be reached or the client cannot start."""
    if not tier_available(cfg, "worker"):
        return UnavailableTier()
    client = None
    try:
        client = connect(cfg)
        tier = MooncakeTier(client, host_chunks, host_views, fingerprint)
    except MooncakeUnavailable as e:
        if client is not None:
            client.close()
        refuse_or_warn(cfg, "worker", str(e))
        return UnavailableTier()
    logger.info("Mooncake tier: master %s over %s, %d MiB contributed to the pool",
                cfg.master, cfg.protocol, cfg.segment_bytes >> 20)
    return tier
