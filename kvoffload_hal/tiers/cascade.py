"""Scheduler side of a secondary tier: write-through spills and asynchronous promotions.

* **Spill (write-through).** When a device->CPU store is published, its blocks
  are also queued for the tier (those the tier has room for). The CPU block stays
  referenced until every rank wrote it, so it cannot be reused mid-write.
  Write-through was chosen over write-on-evict because vLLM's BlockPool evicts
  inside ``get_new_blocks`` without a hook: by the time a block is known to be
  evicted its bytes are already being overwritten.
* **Promotion.** When a lookup finds the CPU hit continued by blocks the tier
  holds, fresh CPU blocks are allocated and a tier->CPU job is queued; the
  request is told to ask again later (``None``) so the engine step does not
  wait. Once every rank read its blocks, they are published in the CPU prefix
  cache and kept referenced for that request; its next lookup finds a longer
  CPU hit and loads it to the device as usual.
* **Integrity.** A key that failed to read (missing, torn, corrupted) is dropped
  from the index; blocks after it in the request are not published, and the
  request stops promoting (it recomputes instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from kvoffload_hal.logger import init_logger
from kvoffload_hal.tiers.base import BlockKey, TierIndex

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass
class _TierJob:
    promote: bool
    keys: list[BlockKey]
    blocks: list["KVCacheBlock"]
    hashes: list[Any]
    req_id: str | None = None
    reports: int = 0
    failed: set[BlockKey] = field(default_factory=set)
    abandoned: bool = False


class TierCascade:
    def __init__(self, index: TierIndex, cpu_pool: "BlockPool", block_size: int,
                 world_size: int, publish) -> None:
        self.index = index
        self.cpu_pool = cpu_pool
        self.block_size = block_size
        self.world_size = world_size
        self._publish = publish
        self._queued: list[_TierJob] = []
        self._jobs: dict[int, list[_TierJob]] = {}  # one step's jobs share an id
        self._next_job = 0
        self._promoting: dict[str, _TierJob] = {}
        self._promoted: dict[str, list[KVCacheBlock]] = {}
        self._no_promotion: set[str] = set()
        self.blocks_spilled = 0
        self.blocks_promoted = 0

    # --------------------------------------------------------------- spill
    def on_published(self, blocks: list["KVCacheBlock"], hashes: list[Any]) -> None:
        keys = [h.hex() for h in hashes]
        accepted = set(self.index.reserve(keys))
        chosen = [(k, b, h) for k, b, h in zip(keys, blocks, hashes) if k in accepted]
        if not chosen:
            return
        keys, blocks, hashes = map(list, zip(*chosen))
        self.cpu_pool.touch(blocks)  # read by the tier until every rank wrote it
        self._queued.append(_TierJob(False, keys, blocks, hashes))

    # ----------------------------------------------------------- promotion
    def lookup(self, request: "Request", first_block: int, max_blocks: int) -> bool:
        """Start or await a promotion of the blocks after ``first_block``.

        Returns True when the request must ask again later.
        """
        req_id = request.request_id
        if req_id in self._promoting:
            return True
        if req_id in self._no_promotion:
            return False
        hashes = [make_block_hash_with_group_id(h, 0)
                  for h in request.block_hashes[first_block:max_blocks]]
        keys = [h.hex() for h in hashes]
        n = min(self.index.ready_run(keys), self.cpu_pool.get_num_free_blocks())
        if n <= 0:
            return False
        keys, hashes = keys[:n], hashes[:n]
        self.index.pin(keys)
        job = _TierJob(True, keys, self.cpu_pool.get_new_blocks(n), hashes, req_id)
        self._queued.append(job)
        self._promoting[req_id] = job
        return True

    def release_promoted(self, req_id: str) -> None:
        """Drop the pins kept on promoted blocks once the request looked them up again."""
        blocks = self._promoted.pop(req_id, None)
        if blocks:
            self.cpu_pool.free_blocks(blocks)

    def request_finished(self, req_id: str) -> None:
        self.release_promoted(req_id)
        self._no_promotion.discard(req_id)
        job = self._promoting.pop(req_id, None)
        if job is not None:
            job.req_id = None  # completes normally, but nobody keeps the blocks

    # ---------------------------------------------------------- per step
    def take_jobs(self) -> tuple[tuple[int, list], tuple[int, list], list[BlockKey]]:
        """(spill job, promote job, keys to delete) for this step's metadata; -1 = none."""
        out = []
        for promote in (False, True):
            jobs = [j for j in self._queued if j.promote == promote]
            if not jobs:
                out.append((-1, []))
                continue
            job_id = self._next_job
            self._next_job += 1
            self._jobs[job_id] = jobs
            out.append((job_id, [(k, b.block_id) for j in jobs for k, b in zip(j.keys, j.blocks)]))
        self._queued.clear()
        return out[0], out[1], self.index.take_evicted()

    def on_reports(self, reports: dict[int, int], failed: dict[int, list[BlockKey]]) -> None:
        """``reports``: ranks done per job; ``failed``: keys failed on any rank."""
        for job_id, n in reports.items():
            jobs = self._jobs.get(job_id)
            if jobs is None:
                continue
            bad = set(failed.get(job_id, ()))
            for job in jobs:
                job.failed.update(bad.intersection(job.keys))
                job.reports += n
            if jobs[0].reports >= self.world_size:
                del self._jobs[job_id]
                for job in jobs:
                    (self._finish_promotion if job.promote else self._finish_spill)(job)

    def _finish_spill(self, job: _TierJob) -> None:
        ok = [k for k in job.keys if k not in job.failed]
        if job.abandoned:
            self.index.drop(job.keys)
        else:
            self.index.commit(ok)
            self.index.drop(job.failed)
            self.blocks_spilled += len(ok)
        self.cpu_pool.free_blocks(job.blocks)

    def _finish_promotion(self, job: _TierJob) -> None:
        self.index.unpin(job.keys)
        self.index.drop(job.failed)
        # Publish up to the first failed key: a prefix hit must be contiguous.
        n_ok = next((i for i, k in enumerate(job.keys) if k in job.failed), len(job.keys))
        if not job.abandoned:
            for block, block_hash in zip(job.blocks[:n_ok], job.hashes[:n_ok]):
                self._publish(self.cpu_pool, block, block_hash)
            self.blocks_promoted += n_ok
        if job.req_id is not None:
            self._promoting.pop(job.req_id, None)
            if job.failed:
                self._no_promotion.add(job.req_id)
            # Published blocks stay referenced until the request's next lookup.
            self._promoted[job.req_id] = job.blocks[:n_ok]
            self.cpu_pool.free_blocks(job.blocks[n_ok:])
        else:
            self.cpu_pool.free_blocks(job.blocks)

    # --------------------------------------------------------------- misc
    def reset(self) -> None:
        for jobs in self._jobs.values():
            for job in jobs:
                job.abandoned = True
        for job in self._queued:  # never sent: release now
            if job.promote:
                self.index.unpin(job.keys)
                if job.req_id is not None:
                    self._promoting.pop(job.req_id, None)
            else:
                self.index.drop(job.keys)
            self.cpu_pool.free_blocks(job.blocks)
        self._queued.clear()
        self.index.evict_all()

    def has_pending(self) -> bool:
        return bool(self._queued or self._jobs)
