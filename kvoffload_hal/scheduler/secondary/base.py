"""What one tier's scheduler half answers, each call doing nothing by default.

Runs in the scheduler process. :class:`SchedulerTier` is the base of every tier's
machinery (:class:`~kvoffload_hal.scheduler.secondary.promotions.PromotingTier`, built
from the tier's :class:`~kvoffload_hal.tiers.spec.SchedulerHalf` by
:func:`~kvoffload_hal.scheduler.secondary.build.build_chain`); ``scheduler/core.py``
calls the chain of them, :class:`~kvoffload_hal.scheduler.secondary.chain.TierChain`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from kvoffload_hal.metadata import JobReport, TierJobs
from kvoffload_hal.scheduler.parts import RequestPart
from kvoffload_hal.scheduler.room import RoomKind

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

    from kvoffload_hal.scheduler.cpu_tier import Hit
    from kvoffload_hal.tiers.spec import BlockKey

NO_TIER_JOBS = TierJobs()


class TierNames(NamedTuple):
    """How counters (``blocks_to_<name>``, ...) and log lines (``label``) name a tier."""

    name: str = "tier"
    label: str = "secondary tier"


class SchedulerTier(RequestPart):
    """One tier's calls, each doing nothing (see the module docstring)."""

    stages = False  # whether hits longer than the CPU tier's room are staged (staged.py)
    names = TierNames()

    def may_stage(self) -> bool:
        """Whether a hit may be staged now (a shared tier: while its breaker is closed)."""
        return self.stages

    def bind_copies(self, copies_in_flight: Callable[[], bool]) -> None:
        """``copies_in_flight()``: whether the CPU tier's own loads or stores hold CPU
        blocks that they release when they end."""

    def on_published(self, blocks: list[KVCacheBlock], hashes: list[Any]) -> None:
        """Blocks were just published in the CPU tier (write-through)."""

    def on_found(self, keys: list[BlockKey], ranks_done: int) -> None:
        """Blocks the workers found from before a restart; ranks done looking."""

    def lookup(self, request: Request, hit: Hit, first_block: int, end_block: int,
               kind: RoomKind = RoomKind.PROMOTIONS, max_blocks: int | None = None) -> bool:
        """After a CPU hit ``hit``: True when the request must ask again later.
        ``kind``: whose room a promotion takes (a prefetch's, or a lookup's);
        ``max_blocks``: promote at most that many CPU blocks (a prefetch's budget)."""
        return False

    def release_all_kept(self) -> None:
        """Let go of every block kept for a request's next lookup."""

    def held_for(self, req_id: str, promoting_only: bool = False) -> int:
        """CPU blocks promoted (unless ``promoting_only``), or being promoted, for the
        request and kept for it."""
        return 0

    def release_promoted(self, req_id: str) -> None:
        """Drop the pins kept on blocks promoted for the request (it pinned its hit)."""

    def request_finished(self, req_id: str) -> bool:
        """Forget the request; a promotion in flight completes without it (False: it
        never holds the request's device blocks)."""
        return False

    def take_jobs(self) -> TierJobs:
        """This step's jobs for the workers."""
        return NO_TIER_JOBS

    def on_reports(self, reports: dict[int, JobReport]) -> None:
        """Job reports from the workers, summed over ranks."""

    def reset(self) -> None:
        """Forget every entry; jobs in flight finish but are not published."""

    def has_pending(self) -> bool:
        return False
