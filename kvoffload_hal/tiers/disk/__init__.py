"""The local-disk tier: its keys, and both halves.

=====================  ==========  =================================================
key                    default     meaning
=====================  ==========  =================================================
``disk_path``          (none)      directory of a disk tier behind the CPU tier
                                   (created private if missing; must be writable;
                                   absolute, or starting with ``~``)
``disk_bytes_to_use``  (none)      disk tier capacity for the whole instance, split
                                   across ranks (int bytes > 0; needs ``disk_path``)
``disk_o_direct``      ``false``   bypass the page cache for disk-tier IO
``disk_retention``     ``keep``    ``keep``: blocks outlive the server; a restarted
                                   server with the same fingerprint finds them.
                                   ``remove``: a clean shutdown removes them
``disk_shared``        ``false``   also read the blocks other running engines with
                                   the same fingerprint wrote under ``disk_path``
                                   (the data-parallel ranks of a host): lookups
                                   that miss ask the workers whether a file exists
``disk_timeout_s``     ``10.0``    longest a read or a write of the disk is waited
                                   for: past it the request recomputes and the
                                   tier's circuit breaker opens (a file system that
                                   stopped answering)
=====================  ==========  =================================================

Writes still in flight when an engine goes idle or stops get ``shutdown_flush_timeout_s``
(a core key: :mod:`kvoffload_hal.config`) to finish, and are dropped whole after it.

The scheduler keeps ``disk_bytes_to_use / (TP x PP)`` bytes' worth of blocks per
rank, and rebuilds its index from the kept directory after a restart, before the first
request (the workers list it and hand the keys over at start-up); the worker half is
:class:`~kvoffload_hal.tiers.disk.worker.DiskTier`, one private directory per
rank. Models with several KV cache groups keep one file per (group, block).

Every disk tier's reads and writes are bounded by ``disk_timeout_s``, past which the
tier's circuit breaker opens (``scheduler/secondary/breaker.py``). With ``disk_shared``
the scheduler half is that of a tier shared across instances
(``scheduler/secondary/shared.py``: an existence query before a hit on blocks it did
not write, bounded too), except that the blocks it evicts
are deleted, from its own directory only: each engine bounds its own files, and
the engines on one ``disk_path`` hold at most the sum of their shares there.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from kvoffload_hal.config_values import boolean, one_of, positive_int, positive_seconds
from kvoffload_hal.logger import init_logger
from kvoffload_hal.tiers.disk.dirs import DIR_MODE, check_private_dir
from kvoffload_hal.tiers.spec import (
    CapacityClaim,
    SchedulerHalf,
    SchedulerTierContext,
    SecondaryTier,
    TierSpec,
    WorkerTierContext,
)

logger = init_logger(__name__)

RETENTIONS = ("keep", "remove")
# disk_timeout_s's default: the longest a read or a write of the disk tier is waited
# for, past which a request recomputes and the tier's circuit breaker opens
# (scheduler/secondary/breaker.py). A local disk answers in milliseconds; this bounds
# a hung one (a network file system that stopped answering), as the CPU tier's own
# wait for room does (scheduler/secondary/reads.py: MAX_ROOM_WAIT_S).
WAIT_S = 10.0


class DiskTierSpec(TierSpec):
    name = "disk"
    label = "disk tier"
    one_group_only = False  # one entry per (group, block): scheduler/secondary/plan.py
    switch_key = "disk_path"
    keys = ("disk_path", "disk_bytes_to_use", "disk_o_direct", "disk_retention",
            "disk_shared", "disk_timeout_s")

    def __init__(self, path: str, bytes_to_use: int, o_direct: bool = False,
                 retention: str = "keep", shared: bool = False,
                 timeout_s: float = WAIT_S) -> None:
        self.path = path
        self.bytes_to_use = bytes_to_use
        self.o_direct = o_direct
        self.timeout_s = timeout_s
        self.keep = retention == "keep"
        # Per instance: the scheduler then builds the shared tier's own scheduler side, and
        # vLLM's sleep mode is refused (peers keep serving pre-sleep blocks).
        self.shared_across_instances = shared

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> DiskTierSpec | None:
        o_direct = boolean("disk_o_direct", extra.get("disk_o_direct", False))
        retention = one_of("disk_retention", extra.get("disk_retention", "keep"),
                           RETENTIONS)
        shared = boolean("disk_shared", extra.get("disk_shared", False))
        timeout_s = positive_seconds("disk_timeout_s", extra.get("disk_timeout_s", WAIT_S))
        path = extra.get("disk_path")
        if path is None:
            for key in ("disk_bytes_to_use", "disk_o_direct", "disk_retention",
                        "disk_shared", "disk_timeout_s"):
                if extra.get(key) not in (None, False):
                    raise ValueError(f"kv_connector_extra_config['{key}'] is set but "
                                     "'disk_path' is not: expected both for a disk tier")
            return None
        path = _absolute_dir(path)
        if "disk_bytes_to_use" not in extra:
            raise ValueError("kv_connector_extra_config['disk_path'] is set but "
                             "'disk_bytes_to_use' is not: expected an integer number of bytes > 0")
        bytes_to_use = positive_int("disk_bytes_to_use", extra["disk_bytes_to_use"])
        _check_writable_dir(path)
        return cls(path, bytes_to_use, o_direct, retention, shared, timeout_s)

    def capacity_claims(self, world_size: int) -> list[CapacityClaim]:
        return [CapacityClaim("disk_bytes_to_use", self.bytes_to_use // max(1, world_size),
                              shutil.disk_usage(self.path).free, f"free in {self.path}")]

    def scheduler_half(self, ctx: SchedulerTierContext) -> SchedulerHalf:
        blocks = ctx.blocks_for("disk_bytes_to_use",
                                self.bytes_to_use // max(1, ctx.world_size))
        logger.info("HALOffloadConnector: disk tier of %d blocks at %s%s", blocks, self.path,
                    ", shared with the engines of the same fingerprint there"
                    if self.shared_across_instances else "")
        return SchedulerHalf(blocks, rebuild=True, wait_s=self.timeout_s,
                             deletes_evicted=True)

    def worker_half(self, ctx: WorkerTierContext) -> SecondaryTier:
        from kvoffload_hal.tiers.disk.worker import DiskTier
        from kvoffload_hal.tiers.identity import restart_warning

        keep = self.keep
        warning = restart_warning(keep, self.path, ctx.block_hash_algo)
        if warning is not None:  # its blocks could never be found: nothing to adopt
            if ctx.rank == 0:
                logger.warning("%s; the blocks of earlier servers are removed", warning)
            keep = False
        return DiskTier(self.path, ctx.rank, ctx.host_views, self.o_direct, ctx.fingerprint,
                        keep=keep, shared=self.shared_across_instances)


def _absolute_dir(value: Any) -> str:
    """``disk_path`` with ``~`` expanded; a relative path would depend on each
    process's working directory (scheduler and workers may differ), so it is refused."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"kv_connector_extra_config['disk_path']={value!r}: "
                         "expected a directory path")
    path = os.path.expanduser(value)
    if not os.path.isabs(path):
        raise ValueError(f"kv_connector_extra_config['disk_path']={value!r}: expected an "
                         "absolute path (or one starting with ~)")
    return path


def _check_writable_dir(path: str) -> None:
    try:
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)  # created private: KV reveals prompts
        check_private_dir(path, "kv_connector_extra_config['disk_path']")
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(
            f"kv_connector_extra_config['disk_path']={path!r}: expected a writable directory "
            f"({e.strerror or e})"
        ) from None
