"""The served connector with its scheduler hooks timed and its tiers read.

``HALOffloadConnector`` itself serves; this subclass only measures, in the
scheduler process: every scheduler hook is timed with ``perf_counter`` and the
hooks of one engine step (one ``build_connector_meta`` to the next) are summed;
a daemon thread writes, once a second, a JSON snapshot to ``$SOAK_PROBE_FILE``:
the per-step hook times since the last snapshot, the CPU tier's resident and
pinned blocks and the blocks it evicted, the secondary tier's index size and the
keys it handed to the workers to delete, and the scheduler's counters. Loaded by
vLLM with ``kv_connector_module_path="soak.probe_connector"``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from kvoffload_hal.connector import HALOffloadConnector

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
        self._counts = {"cpu_published": 0, "cpu_evicted": 0, "tier_reserved": 0,
                        "tier_evicted": 0, "steps": 0}
        self._wrap_hooks()
        self._count_evictions()
        threading.Thread(target=self._snapshots, name="soak-probe", daemon=True).start()

    # ------------------------------------------------------------ timing
    def _wrap_hooks(self) -> None:
        for name in HOOKS:
            hook = getattr(self, name, None)
            if hook is not None:
                setattr(self, name, self._timed(hook, name == "build_connector_meta"))

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
        call = getattr(owner, name, None)
        if call is None:
            return

        def counted(*args: Any, **kwargs: Any) -> Any:
            result = call(*args, **kwargs)
            self._counts[counter] += size(args, result)
            return result
        setattr(owner, name, counted)

    def _count_evictions(self) -> None:
        cpu = self.scheduler.cpu
        self._count(cpu, "publish", "cpu_published", lambda args, _: len(args[0]))
        index = getattr(self.scheduler.tiers.nearest, "index", None)
        if index is not None:
            self._count(index, "reserve", "tier_reserved", lambda _, accepted: len(accepted))
        self._count(cpu.pool, "_maybe_evict_cached_block", "cpu_evicted",
                    lambda _, evicted: int(bool(evicted)))
        if index is not None:  # keys the workers are told to delete
            self._count(index, "take_evicted", "tier_evicted", lambda _, keys: len(keys))

    # --------------------------------------------------------- snapshots
    def snapshot(self) -> dict[str, Any]:
        steps, self._steps = self._steps, []
        sched = self.scheduler
        cpu = sched.cpu
        blocks = cpu.pool.blocks[:cpu.num_blocks]
        index = getattr(sched.tiers.nearest, "index", None)
        return {
            "t": time.time(), "step_hook_s": steps, **self._counts,
            "cpu_resident": sum(1 for b in blocks if b.block_hash is not None),
            "cpu_pinned": cpu.num_pinned_blocks(), "cpu_blocks": cpu.num_blocks,
            "tier_index": len(index) if index is not None else None,
            "tier_ready": (sum(1 for e in index._entries.values() if e.ready)
                           if index is not None else None),
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
