"""What a staged hit is, and how a lookup decides one: the run, its positions, its rounds.

Runs in the scheduler process; :mod:`.staged` serves the hits decided here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvoffload_hal.scheduler.cascade.tier_cascade import TierCascade
    from kvoffload_hal.scheduler.cpu_tier import CpuTier


@dataclass
class Staged:
    """One request's staged hit. Positions count blocks from its first computed token
    on: the CPU hit first, then the run."""

    req_id: str
    cpu: list[tuple[int, KVCacheBlock]]  # positions the CPU tier holds, pinned
    tier: list[tuple[int, str, Any]]  # positions the tier brings: (position, key, hash)
    num_tokens: int  # offered
    num_computed_tokens: int
    since: float  # the last progress
    gpu_ids: list[int] = field(default_factory=list)  # per position, once allocated
    ready: list[tuple[KVCacheBlock, int]] = field(default_factory=list)  # (CPU, device)
    loaded: list[int] = field(default_factory=list)  # device blocks of rounds sent
    final_blocks: list[KVCacheBlock] = field(default_factory=list)  # with the last round
    final_gpu_ids: list[int] = field(default_factory=list)
    next: int = 0  # the next entry of ``tier`` to promote
    promoting: list[tuple[int, str, Any]] | None = None  # the part being promoted
    rounds: int = 0  # rounds sent and not reported
    failed_at: int | None = None  # the first position not served
    final_sent: bool = False
    aborted: bool = False

    @property
    def keys(self) -> list[str]:
        return [key for _, key, _ in self.tier]

    def stops(self) -> bool:
        """No more promotions: all sent, a failure, or the request is gone."""
        return self.failed_at is not None or self.aborted or self.next >= len(self.tier)

    def fail_from(self, position: int) -> None:
        self.failed_at = position if self.failed_at is None else min(self.failed_at, position)

    def give_up_if_overdue(self, now: float, wait_s: float | None) -> None:
        """A tier shared across instances answers within its wait, or the hit stops at
        the part being read (the rest is recomputed; the breaker hears of the overdue
        job from the cascade). The late read's blocks are let go when it ends."""
        if self.promoting is None or wait_s is None or now - self.since <= wait_s:
            return
        self.fail_from(self.promoting[0][0])
        self.promoting = None

    def take_round(self) -> Round:
        """A round of the blocks ready in the CPU tier."""
        cpu_blocks, gpu_ids = [b for b, _ in self.ready], [g for _, g in self.ready]
        self.ready = []
        self.rounds += 1
        self.loaded += gpu_ids
        return Round(self.req_id, cpu_blocks, gpu_ids)

    def take_final(self) -> Round:
        """The request's load: what is ready, and the device blocks nothing fills."""
        self.final_blocks = [b for b, _ in self.ready]
        self.final_gpu_ids = gpu_ids = [g for _, g in self.ready]
        self.ready = []
        self.final_sent = True
        served = {*gpu_ids, *self.loaded}
        failed = tuple(g for g in self.gpu_ids if g not in served)
        return Round(self.req_id, self.final_blocks, gpu_ids, failed)


class NotStaged(Enum):
    """Why :func:`plan_run` stages nothing."""

    FITS = "a promotion serves the run whole, or there is nothing to get"
    WAIT = "another request's promotion brings a block of the run: ask again later"


def plan_run(cascade: TierCascade, cpu: CpuTier, req_id: str, hit_blocks: list[KVCacheBlock],
              entries: Iterator[tuple[str, Any]], block_size: int,
              now: float) -> Staged | NotStaged:
    """The run of the tier's blocks after the hit, when it is longer than the room a
    promotion has; else why not."""
    if cascade.held_for(req_id, promoting_only=True):
        return NotStaged.FITS  # its promotion (a prefetch) is in flight: the cascade waits
    held: list[tuple[int, KVCacheBlock]] = list(enumerate(hit_blocks))
    tier: list[tuple[int, str, Any]] = []
    for pos, (key, block_hash) in enumerate(entries, start=len(hit_blocks)):
        if cascade.is_promoting(key):
            return NotStaged.WAIT
        cached = cpu.cached([block_hash])
        if cached:
            held.append((pos, cached[0]))
        elif cascade.index.is_ready(key):
            tier.append((pos, key, block_hash))
        else:
            break
    # The room a promotion has once the CPU blocks of the hit and run are pinned.
    if len(tier) <= cascade.room() - sum(1 for _, b in held if b.ref_cnt == 0):
        return NotStaged.FITS
    # Every position of the run, the CPU blocks after its last tier block too: vLLM asks
    # for a request's external tokens once.
    last = max(tier[-1][0], held[-1][0] if held else 0)
    return Staged(req_id, held, tier, (last + 1) * block_size, 0, now)


@dataclass
class Round:
    """A round decided this step, sent with the step's metadata; ``failed`` is set
    (maybe empty) on the request's last round."""

    req_id: str
    cpu_blocks: list[KVCacheBlock]
    gpu_ids: list[int]
    failed: tuple[int, ...] | None = None
