"""Transfer statistics and their Prometheus metrics (``vllm:kvoffload_hal_*``).

Both sides report: the scheduler counts blocks published and loaded and the CPU
hit tokens; the worker counts bytes moved, copy time and failed jobs. vLLM sums
:class:`OffloadStats` over ranks and steps with :meth:`OffloadStats.aggregate`
and hands the data to :class:`OffloadPromMetrics.observe`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    from kvoffload_hal.hal.backend import DmaCopyBackend

# name -> help text. Every field is a monotonically increasing counter.
COUNTERS: dict[str, str] = {
    "blocks_stored": "KV blocks copied device->CPU and published in the CPU tier",
    "blocks_rescued": "KV blocks the device reused while the CPU tier held no copy, copied "
                      "to the CPU tier before the step's forward pass wrote them "
                      "(device_copies=drop; also in blocks_stored)",
    "blocks_handed_over": "Rescued KV blocks copied into the CPU blocks of the same step's "
                          "loads once those had run (device_copies=drop; also in "
                          "blocks_rescued)",
    "blocks_rescued_for_lookups": "Rescued KV blocks a later lookup of the same step asked "
                                  "for, published at that lookup (device_copies=drop; also "
                                  "in blocks_rescued)",
    "blocks_loaded": "KV blocks copied CPU->device for prefix hits",
    "cpu_hit_tokens": "Prompt tokens served from the CPU tier instead of recomputed",
    "shared_load_waits": "Requests that waited for another request's load of the same CPU "
                         "blocks (then hit the device prefix cache) instead of copying them again",
    "staged_hits": "Tier hits longer than the CPU tier's room, served in full through it in "
                   "rounds (promote, load, release, the next blocks)",
    "bytes_stored": "Bytes copied device->CPU (per rank, summed)",
    "bytes_loaded": "Bytes copied CPU->device (per rank, summed)",
    "store_seconds": "Time spent in device->CPU copies",
    "load_seconds": "Time spent in CPU->device copies",
    "failed_jobs": "Copy jobs that failed (their blocks are recomputed, never used)",
    "blocks_prefetched": "KV blocks queued for promotion from a secondary tier into the CPU "
                         "tier for a waiting request before vLLM's scheduler looked it up",
    "copy_path_fallbacks": "Workers whose backend left its batched copy call for a per-copy "
                           "loop because the runtime answered 'not supported'",
}


# A secondary tier's counters, named after the tier (``TierSpec.name``): for the
# built-in tiers, blocks_to_disk, mooncake_timeouts, ...
TIER_COUNTERS: dict[str, str] = {
    "blocks_to_{name}": "KV blocks written from the CPU tier to the {label}",
    "blocks_from_{name}": "KV blocks promoted from the {label} to the CPU tier",
    "{name}_timeouts": "Queries or reads of the {label} a request stopped waiting for "
                       "(recomputed)",
    "{name}_failed_blocks": "Blocks of the {label} that failed to write or read (missing, "
                            "evicted, corrupted, unreachable): recomputed, never used",
    "{name}_breaker_opens": "Times the {label}'s circuit breaker opened after being closed "
                            "(the tier skipped; opens - closes is 1 while it is open or "
                            "probing)",
    "{name}_breaker_reopens": "Probes of the {label} that failed: skipped again, for a "
                              "longer window",
    "{name}_breaker_closes": "Times the {label}'s circuit breaker closed (the tier answered "
                             "again)",
    "{name}_breaker_skips": "Lookups answered as a miss and spills not sent because the "
                            "{label}'s circuit breaker was open",
}


def tier_counters(name: str, label: str) -> dict[str, str]:
    """The counters of the secondary tier ``name`` (help texts say ``label``)."""
    return {key.format(name=name): doc.format(label=label)
            for key, doc in TIER_COUNTERS.items()}


class _Recorder:
    """The ``record_*`` vocabulary, over one primitive: ``_add(key, value)``."""

    def _add(self, key: str, value: float) -> None:
        raise NotImplementedError

    def record_store(self, num_blocks: int, rescued: bool = False,
                     handed_over: bool = False, for_lookups: int = 0) -> None:
        self._add("blocks_stored", num_blocks)
        if rescued:
            self._add("blocks_rescued", num_blocks)
        if handed_over:
            self._add("blocks_handed_over", num_blocks)
        if for_lookups:
            self._add("blocks_rescued_for_lookups", for_lookups)

    def record_load(self, num_blocks: int, num_tokens: int) -> None:
        self._add("blocks_loaded", num_blocks)
        self._add("cpu_hit_tokens", num_tokens)

    def record_staged_hit(self) -> None:
        self._add("staged_hits", 1)

    def record_shared_load_wait(self) -> None:
        self._add("shared_load_waits", 1)

    def record_prefetch(self, num_blocks: int) -> None:
        self._add("blocks_prefetched", num_blocks)

    def record_tier(self, name: str, spilled: int = 0, promoted: int = 0, timeouts: int = 0,
                    failed: int = 0) -> None:
        """Blocks the secondary tier ``name`` took and gave, waits given up, failed blocks."""
        for key, value in ((f"blocks_to_{name}", spilled), (f"blocks_from_{name}", promoted),
                           (f"{name}_timeouts", timeouts), (f"{name}_failed_blocks", failed)):
            if value:
                self._add(key, value)

    def record_breaker(self, name: str, opened: int = 0, reopened: int = 0, closed: int = 0,
                       skipped: int = 0) -> None:
        """Transitions of the circuit breaker of the secondary tier ``name``."""
        for event, value in (("opens", opened), ("reopens", reopened), ("closes", closed),
                             ("skips", skipped)):
            if value:
                self._add(f"{name}_breaker_{event}", value)

    def record_copy_path_fallback(self) -> None:
        self._add("copy_path_fallbacks", 1)

    def record_transfer(self, store: bool, num_bytes: int, seconds: float, ok: bool) -> None:
        if not ok:
            self._add("failed_jobs", 1)
            return
        self._add("bytes_stored" if store else "bytes_loaded", num_bytes)
        self._add("store_seconds" if store else "load_seconds", seconds)


@dataclass
class OffloadStats(_Recorder, KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def _add(self, key: str, value: float) -> None:
        self.data[key] = self.data.get(key, 0) + value

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> OffloadStats:
        for key, value in other.data.items():
            self._add(key, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in COUNTERS}
        out.update(self.data)  # a secondary tier's own counters
        for direction, nbytes_key in (("store", "bytes_stored"), ("load", "bytes_loaded")):
            seconds = out[f"{direction}_seconds"]
            out[f"{direction}_GBps"] = round(out[nbytes_key] / seconds / 1e9, 3) if seconds else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsLedger(_Recorder):
    """Where one side of the connector records: each record lands in two views.

    ``totals`` runs since start-up (tests, the demo, logs); the step view is
    what vLLM collects every step through :meth:`take_step`.
    """

    def __init__(self) -> None:
        self.totals = OffloadStats()
        self._step = OffloadStats()

    def _add(self, key: str, value: float) -> None:
        self._step._add(key, value)
        self.totals._add(key, value)

    def take_step(self) -> OffloadStats | None:
        """What was recorded since the last call; None when nothing was (most steps)."""
        if self._step.is_empty():
            return None
        step, self._step = self._step, OffloadStats()
        return step


class CopyPathWatch:
    """Counts the copy-path switches of one backend as the worker sees them.

    A backend reports the call its copies go through as
    :attr:`~kvoffload_hal.hal.backend.DmaCopyBackend.copy_path`, known once it is
    bound (build the watch after ``bind``). By the HAL's contract it changes at
    most once, to one of the backend's ``fallback_copy_paths``: when a batched
    call answers "not supported" (CUDA 801, ACL 207000) and the backend moves to
    a per-copy loop for good. :meth:`check`, called after each collection of
    results, records each change once.
    """

    def __init__(self, backend: DmaCopyBackend) -> None:
        self._backend = backend
        self.path: str | None = backend.copy_path

    def check(self, recorder: _Recorder) -> None:
        path = self._backend.copy_path
        if path != self.path:
            recorder.record_copy_path_fallback()
            self.path = path


class OffloadPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per :data:`COUNTERS` entry and per counter of every
    registered secondary tier, per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from kvoffload_hal.tiers.registry import tier_labels

        docs = dict(COUNTERS)
        for name, label in tier_labels().items():
            docs.update(tier_counters(name, label))
        self._counters = {
            key: self._counter_cls(name=f"vllm:kvoffload_hal_{key}", documentation=doc,
                                   labelnames=labelnames)
            for key, doc in docs.items()
        }
        self._children: dict[tuple[int, str], Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            counter = self._counters.get(key)
            if counter is None or not value:
                continue
            child = self._children.get((engine_idx, key))
            if child is None:
                child = counter.labels(*self.per_engine_labelvalues[engine_idx])
                self._children[(engine_idx, key)] = child
            child.inc(value)
