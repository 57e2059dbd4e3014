"""An object store every engine of a test process shares: a third-party tier written
outside the package, ``shared_across_instances`` like the Mooncake tier.

Process memory stands in for the store: one :class:`Store` per ``object_store`` name,
which every engine configured with that name writes and reads. A store can be frozen
(its calls hang until it is thawed, as a stuck network store's do) and objects can
vanish from it (evicted by the store, or by another instance). The tier is what a
third party writes and nothing more: a spec with its keys, the scheduler half's
description, a worker half on ``PooledTier``. The scheduler builds the rest
(existence queries, staged hits, prefetch, the circuit breaker, ``*objstore*``
counters) without naming it.
"""

from __future__ import annotations

import threading
from typing import Any

from kvoffload_hal.config_values import where
from kvoffload_hal.tiers.spec import SchedulerHalf, TierSpec
from kvoffload_hal.tiers.worker_pool import PooledTier

ENTRY_POINT = "support.object_store_tier:ObjectStoreSpec"
KNOWN_KEYS = 4096
FROZEN_LIMIT_S = 30.0  # a frozen store answers after this at the latest


class Store:
    """One named store: ``values[key] = (fingerprint, bytes of each host region)``."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[bytes, list[bytes]]] = {}
        self.lock = threading.Lock()
        self.thawed = threading.Event()
        self.thawed.set()
        self.reads = 0
        self.vanish_after_probe: set[str] = set()  # gone right after a query found them
        self.freeze_after_reads: int | None = None  # freezes once, this many read

    def freeze(self) -> None:
        self.thawed.clear()

    def thaw(self) -> None:
        self.thawed.set()


STORES: dict[str, Store] = {}


class ObjectStoreTier(PooledTier):
    name = "objstore"
    label = "object store"
    batch_items = 8  # a network round trip carries many objects

    def __init__(self, store: Store, host_views, fingerprint: bytes) -> None:
        self.store = store
        self.views = list(host_views)
        self.fingerprint = fingerprint
        super().__init__()

    def _store_batch(self, items):
        self.store.thawed.wait(FROZEN_LIMIT_S)
        values = {key: (self.fingerprint, [v[block].numpy().tobytes() for v in self.views])
                  for key, block in items}
        with self.store.lock:
            self.store.values.update(values)
        return []

    def _load_batch(self, items):
        self.store.thawed.wait(FROZEN_LIMIT_S)
        failed = []
        for key, block in items:
            with self.store.lock:
                value = self.store.values.get(key)
            if value is None or value[0] != self.fingerprint:
                failed.append(key)
                continue
            for view, data in zip(self.views, value[1]):
                view[block].numpy()[:] = memoryview(data)
            self.store.reads += 1
        if self.store.freeze_after_reads is not None \
                and self.store.reads >= self.store.freeze_after_reads:
            self.store.freeze_after_reads = None  # once
            self.store.freeze()
        return failed

    def _probe_batch(self, items):
        self.store.thawed.wait(FROZEN_LIMIT_S)
        with self.store.lock:
            missing = [key for key, _ in items
                       if self.store.values.get(key, (None,))[0] != self.fingerprint]
            for key, _ in items:
                if key in self.store.vanish_after_probe:
                    self.store.values.pop(key, None)
        return missing


class ObjectStoreSpec(TierSpec):
    name = "objstore"
    label = "object store"
    switch_key = "object_store"
    keys = ("object_store", "object_store_timeout_s")
    one_group_only = True
    shared_across_instances = True

    def __init__(self, store: str, timeout_s: float) -> None:
        self.store = store
        self.timeout_s = timeout_s

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ObjectStoreSpec | None:
        store = extra.get("object_store")
        if store is None:
            return None
        if not isinstance(store, str) or not store:
            raise ValueError(f"{where('object_store', store)}: expected a store name")
        timeout_s = extra.get("object_store_timeout_s", 2.0)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or timeout_s <= 0:
            raise ValueError(f"{where('object_store_timeout_s', timeout_s)}: expected a "
                             "number of seconds > 0")
        return cls(store, float(timeout_s))

    def scheduler_half(self, ctx):
        return SchedulerHalf(KNOWN_KEYS, wait_s=self.timeout_s)

    def worker_half(self, ctx):
        return ObjectStoreTier(STORES.setdefault(self.store, Store()), ctx.host_views,
                               ctx.fingerprint)
