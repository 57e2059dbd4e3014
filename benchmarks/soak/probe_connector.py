"""The served connector with its scheduler hooks timed and its tiers read.

``HALOffloadConnector`` itself serves; this subclass only measures, in the
scheduler process: every scheduler hook is timed with ``perf_counter`` and the
hooks of one engine step (one ``build_connector_meta`` to the next) are summed;
a daemon thread writes, once a second, a JSON snapshot to ``$SOAK_PROBE_FILE``:
the per-step hook times since the last snapshot, the CPU tier's resident and
pinned blocks and the blocks it evicted, and for every secondary tier of the chain
(keyed by the tier's name: ``tier_reserved_disk``, ``tier_index_mooncake``, ...) the
keys its index reserved for writes, learned from the store (existence queries, a
restart's scan) and let go (evicted, dropped after a failure), its index size and
ready entries; and the scheduler's counters. Loaded by vLLM with
``kv_connector_module_path="soak.probe_connector"``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from kvoffload_hal.connector import HALOffloadConnector
from kvoffload_hal.scheduler.secondary.shared import SharedTierIndex

HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "take_events",
         "has_pending_block_frees", "has_pending_push_work")
SNAPSHOT_EVERY_S = 1.0


class SoakProbeConnector(HALOffloadConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._path = os.environ.get("SOAK_PROBE_FILE")
        if self.scheduler is None or not self._path:
            return
        self._step_s = 0.0  # hooks of the step under way
        self._steps: list[float] = []  # per-step totals since the last snapshot
        self._counts = {"cpu_published": 0, "cpu_evicted": 0, "steps": 0}
        self._wrap_hooks()
        self._count_evictions()
        threading.Thread(target=self._snapshots, name="soak-probe", daemon=True).start()

    # ------------------------------------------------------------ timing
    def _wrap_hooks(self) -> None:
        for name in HOOKS:
            setattr(self, name, self._timed(getattr(self, name), name == "build_connector_meta"))

    def _timed(self, hook: Any, ends_step: bool) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                self._step_s += time.perf_counter() - start
                if ends_step:
                    self._steps.append(self._step_s)
                    self._step_s = 0.0
                    self._counts["steps"] += 1
        return timed

    # ---------------------------------------------------------- counting
    def _count(self, owner: Any, name: str, counter: str, size: Any) -> None:
        """Wrap ``owner.name`` (an instance attribute) to add ``size(args, result)``."""
        call = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            result = call(*args, **kwargs)
            self._counts[counter] += size(args, result)
            return result
        setattr(owner, name, counted)

    def _count_evictions(self) -> None:
        cpu = self.scheduler.cpu
        self._count(cpu, "publish", "cpu_published", lambda args, _: len(args[0]))
        self._count(cpu.pool, "_maybe_evict_cached_block", "cpu_evicted",
                    lambda _, evicted: int(bool(evicted)))
        for name, index in self._indexes().items():
            self._count_index(name, index)

    def _indexes(self) -> dict[str, Any]:
        """Each secondary tier's index, by the tier's name, nearest first."""
        return {tier.names.name: tier.index for tier in self.scheduler.tiers}

    def _count_index(self, name: str, index: Any) -> None:
        """Keys in (``reserve``; ``learn`` and ``adopt``: net of the drops they cause)
        and out (every entry ``drop`` removes: an eviction, a failure, a reset)."""
        reserved, learned, evicted = (f"tier_{k}_{name}" for k in ("reserved", "learned",
                                                                  "evicted"))
        self._counts.update({reserved: 0, learned: 0, evicted: 0})
        self._count(index, "reserve", reserved, lambda _, accepted: len(accepted))
        drop = index.drop

        def dropping(keys: Any) -> None:
            before = len(index)
            drop(keys)
            self._counts[evicted] += before - len(index)
        index.drop = dropping
        # A shared tier's index also learns keys an existence query found.
        for method in ("learn", "adopt") if isinstance(index, SharedTierIndex) else ("adopt",):
            setattr(index, method, self._net_added(index, getattr(index, method), learned,
                                                   evicted))

    def _net_added(self, index: Any, call: Any, counter: str, evicted: str) -> Any:
        def added(*args: Any, **kwargs: Any) -> Any:
            size, dropped = len(index), self._counts[evicted]
            result = call(*args, **kwargs)
            self._counts[counter] += len(index) - size + self._counts[evicted] - dropped
            return result
        return added

    # --------------------------------------------------------- snapshots
    def snapshot(self) -> dict[str, Any]:
        steps, self._steps = self._steps, []
        sched = self.scheduler
        cpu = sched.cpu
        blocks = cpu.pool.blocks[:cpu.num_blocks]
        indexes = self._indexes()
        tiers: dict[str, Any] = {"tier_names": list(indexes)}
        for name, index in indexes.items():
            tiers[f"tier_index_{name}"] = len(index)
            tiers[f"tier_ready_{name}"] = sum(1 for e in list(index._entries.values())
                                              if e.ready)
        return {
            "t": time.time(), "step_hook_s": steps, **self._counts, **tiers,
            "cpu_resident": sum(1 for b in blocks if b.block_hash is not None),
            "cpu_pinned": cpu.num_pinned_blocks(), "cpu_blocks": cpu.num_blocks,
            "in_flight": sched.num_jobs_in_flight(),
            "totals": dict(sched.totals.data),
        }

    def _snapshots(self) -> None:
        tmp = f"{self._path}.tmp"
        while True:
            time.sleep(SNAPSHOT_EVERY_S)
            try:
                data = self.snapshot()
            except RuntimeError:  # a structure changed under the read: next second
                continue
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self._path)
