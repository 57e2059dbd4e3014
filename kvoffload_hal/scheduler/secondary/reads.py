"""One read of a secondary tier's blocks into CPU blocks, for every caller.

A :class:`TierRead` is a list of entries read for one *reader* (a request) into fresh CPU
blocks, part by part, each as large as the room broker grants the read's kind, and
handed to the read's *sink* once every rank read it: a promotion keeps the blocks for
the request's next lookup, a staged hit loads them in a round, a check lets them go.
From start to end a read owns its keys (pinned in the index, and in the one owner map,
so another request meeting them waits for it); a key that failed on any rank leaves the
index and ends the read there; and one deadline (no room for :data:`MAX_ROOM_WAIT_S`, a
part past the tier's wait) stops it where it is (docs/design.md, "One read, one
room").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvoffload_hal.logger import init_logger, log_once
from kvoffload_hal.scheduler.room import RoomKind
from kvoffload_hal.scheduler.secondary.plan import Entry
from kvoffload_hal.scheduler.secondary.spill import JobKind, TierJob

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvoffload_hal.metrics import StatsLedger
    from kvoffload_hal.scheduler.cpu_tier import CpuTier
    from kvoffload_hal.scheduler.room import CpuRoom
    from kvoffload_hal.scheduler.secondary.promotions import PromotingTier
    from kvoffload_hal.tiers.spec import BlockKey

# The longest a read, or a request waiting to start one, goes without CPU room before
# the rest of its blocks is recomputed.
MAX_ROOM_WAIT_S = 10.0

logger = init_logger(__name__)

# sink(read, part, blocks, n_ok): a part was read; ``blocks`` (pinned) are the sink's now.
Sink = Callable[["TierRead", list[Entry], list["KVCacheBlock"], int], None]


def starved(since: float, now: float, label: str, what: str) -> bool:
    """Whether ``what`` went without CPU room for :data:`MAX_ROOM_WAIT_S` (said once)."""
    if now - since <= MAX_ROOM_WAIT_S:
        return False
    log_once(logger, logging.WARNING, "%s: %s found no free CPU block for %.0f s; the "
             "rest of its prompt is recomputed", label, what, MAX_ROOM_WAIT_S)
    return True


@dataclass(eq=False)
class TierRead:
    """One reader's entries, read in order, part by part (see the module docstring)."""

    source: PromotingTier
    reader: str
    entries: list[Entry]
    sink: Sink
    kind: RoomKind
    since: float  # the last progress
    what: str = "a read"  # how a log line names it
    next: int = 0  # the next entry to queue
    part: list[Entry] | None = None  # the part being read
    stopped_at: int | None = None  # the first entry not read: a failure or the deadline
    ended: bool = False
    cancelled: bool = False  # a reset took its queued part back unread
    in_flight: list[list[Entry]] = field(default_factory=list)  # parts whose job is out

    @property
    def keys(self) -> list[BlockKey]:
        return [key for key, _ in self.entries]

    def left(self) -> int:
        """Entries still to queue."""
        return 0 if self.stopped_at is not None else len(self.entries) - self.next

    def over(self) -> bool:
        """Nothing in flight and nothing more to queue."""
        return self.part is None and self.left() == 0

    def stop(self, index: int) -> None:
        """Read nothing from entry ``index`` on."""
        self.stopped_at = index if self.stopped_at is None else min(self.stopped_at, index)
        self.part = None


class TierReads:
    """Every read of every tier in the chain, their owner map and their deadline."""

    def __init__(self, cpu: CpuTier, room: CpuRoom, stats: StatsLedger,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cpu = cpu
        self.room = room
        self.stats = stats
        self.clock = clock
        self.owners: dict[BlockKey, TierRead] = {}

    def start(self, source: PromotingTier, reader: str, entries: list[Entry], sink: Sink,
              kind: RoomKind, what: str = "a read") -> TierRead:
        """A read of ``entries`` from ``source`` for ``reader``; it owns their keys
        until :meth:`end`."""
        read = TierRead(source, reader, entries, sink, kind, self.clock(), what)
        source.index.pin(read.keys)
        self.owners.update((key, read) for key in read.keys)
        return read

    def brings_for_another(self, keys: Iterable[BlockKey], reader: str) -> bool:
        """Whether another reader's read brings one of ``keys`` (``reader`` waits for it)."""
        owners = self.owners
        return bool(owners) and any(
            (read := owners.get(key)) is not None and read.reader != reader for key in keys)

    def keep_only(self, read: TierRead, keep: Callable[[int], bool]) -> None:
        """Give up the entries whose index ``keep`` refuses, before anything is queued."""
        assert read.next == 0 and read.part is None, "a read is trimmed before it starts"
        gone = [key for i, (key, _) in enumerate(read.entries) if not keep(i)]
        read.entries = [e for i, e in enumerate(read.entries) if keep(i)]
        self._let_go(read, gone)

    def end(self, read: TierRead) -> None:
        """The reader is done: its keys are let go, but those of a part still in flight,
        whose pins go when its job ends."""
        if read.ended:
            return
        read.ended = True
        out = {key for part in read.in_flight for key, _ in part}
        self._let_go(read, [k for k in read.keys if k not in out])

    def _let_go(self, read: TierRead, keys: list[BlockKey]) -> None:
        read.source.index.unpin(keys)
        for key in keys:
            if self.owners.get(key) is read:
                del self.owners[key]

    def advance(self, read: TierRead, room: int | None = None) -> bool:
        """Queue the read's next part, of at most ``room`` entries (default: what the
        broker grants its kind), unless one is in flight; apply the deadline. False when
        the read wanted room and got none."""
        now = self.clock()
        if read.part is not None:
            if self.overdue(read):
                read.stop(read.next - len(read.part))  # read late: the rest is recomputed
                self.stats.record_tier(read.source.names.name, timeouts=1)
            return True
        if read.over() or read.ended:
            return True
        left = read.left()
        n = self.room.grant(read.kind, left) if room is None else min(room, left)
        if n <= 0:
            if starved(read.since, now, read.source.names.label, read.what):
                read.stop(read.next)
            return False
        part = read.entries[read.next:read.next + n]
        read.next += n
        read.part = part
        read.since = now
        read.in_flight.append(part)
        read.source.queue(TierJob(
            JobKind.PROMOTE, [k for k, _ in part], self.cpu.allocate(n), [h for _, h in part],
            on_done=lambda job, n_ok: self._part_read(read, part, job, n_ok)))
        return True

    def overdue(self, read: TierRead) -> bool:
        """Whether the part in flight is past its tier's wait."""
        return read.part is not None and self.clock() - read.since > read.source.wait_s

    def finish(self, job: TierJob, source: PromotingTier) -> None:
        """Every rank reported a part read from ``source``: failed keys leave its index,
        what read before the first of them is published, and the read hears of it."""
        source.index.drop(job.failed)
        n_ok = next((i for i, k in enumerate(job.keys) if k in job.failed), len(job.keys))
        if not job.abandoned:
            self.cpu.publish(job.blocks[:n_ok], job.hashes[:n_ok])
            self.stats.record_tier(source.names.name, promoted=n_ok)
        job.on_done(job, n_ok)

    def cancel(self, job: TierJob) -> None:
        """A part never sent (a reset): nothing read, nothing published."""
        job.cancelled = True
        job.on_done(job, 0)

    def _part_read(self, read: TierRead, part: list[Entry], job: TierJob, n_ok: int) -> None:
        blocks = job.blocks
        read.in_flight.remove(part)
        read.cancelled = read.cancelled or job.cancelled
        if read.ended:
            self._let_go(read, [k for k, _ in part])
            self.cpu.unpin(blocks)
            return
        if read.part is not part:  # given up (late): the blocks were never the sink's
            self.cpu.unpin(blocks)
            return
        read.part = None
        read.since = self.clock()
        if n_ok < len(part):
            read.stop(read.next - len(part) + n_ok)
        read.sink(read, part, blocks, n_ok)
