"""Connector configuration, read from ``kv_transfer_config.kv_connector_extra_config``.

=====================  ==========  =================================================
key                    default     meaning
=====================  ==========  =================================================
``cpu_bytes_to_use``   4 GiB       host memory of the CPU tier for the whole
                                   instance, split evenly across TP x PP ranks
                                   (int bytes > 0)
``lazy_offload``       ``false``   ``false``: store every full block once computed
                                   (eager); ``true``: store only the device blocks
                                   next in line for eviction (lazy)
``disk_path``          (none)      directory of a disk tier behind the CPU tier
                                   (created if missing; must be writable)
``disk_bytes_to_use``  (none)      disk tier capacity for the whole instance, split
                                   across ranks (int bytes > 0; needs ``disk_path``)
``disk_o_direct``      ``false``   bypass the page cache for disk-tier IO
``allow_overcommit``   ``false``   accept a rank's share of ``cpu_bytes_to_use``
                                   larger than the memory available when it
                                   starts, or of ``disk_bytes_to_use`` larger than
                                   the free space of ``disk_path``; refused
                                   otherwise, before anything is allocated
``load_mode``          ``auto``    ``sync``: a CPU hit is loaded before the forward
                                   pass of the step that schedules the request;
                                   ``async``: the request waits for its load over
                                   one or more steps; ``auto``: ``sync`` where the
                                   copy backend's compute is synchronous (vLLM's
                                   CPU platform) with one KV cache group, else
                                   ``async``
``eviction``           adaptive    order in which the CPU tier evicts: ``lru``
                                   (vLLM's ``BlockPool`` order) or ``adaptive``
                                   (each released block to the head or the tail
                                   of that order by what happened to it since it
                                   was stored, as the best of four candidate
                                   insertions on sampled shadows says; see
                                   ``eviction.py``)
=====================  ==========  =================================================

The Mooncake tier (``tiers/mooncake_config.py``; not with ``disk_path``):

==============================  ===============  ======================================
key                             default          meaning
==============================  ===============  ======================================
``mooncake_master``             (none)           ``host:port`` of ``mooncake_master``:
                                                 a cluster-wide tier behind the CPU tier
``mooncake_protocol``           ``tcp``          ``tcp``, ``rdma`` or ``ascend``
``mooncake_local_hostname``     ``127.0.0.1``    address peers reach this instance at
                                                 (required off loopback)
``mooncake_metadata_server``    ``P2PHANDSHAKE`` Mooncake's metadata service
``mooncake_rdma_devices``       ``""``           RDMA devices (empty: all)
``mooncake_segment_bytes``      1 GiB            host memory each rank adds to the pool
``mooncake_buffer_bytes``       64 MiB           the client's transfer buffer
``mooncake_timeout_s``          5.0              longest wait for a query or a read
``mooncake_connect_timeout_s``  5.0              longest wait for the master at start-up
``mooncake_required``           ``false``        refuse to start without the master
==============================  ===============  ======================================

Validated once at start-up: a wrong type or range raises ``ValueError`` naming the
key, the value and what was expected; unknown keys give one warning listing the
valid keys.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from typing import Any

from kvoffload_hal.config_values import boolean, one_of, positive_int
from kvoffload_hal.logger import init_logger
from kvoffload_hal.scheduler.eviction import DEFAULT_EVICTION, EVICTION_POLICIES
from kvoffload_hal.tiers.disk.dirs import DIR_MODE, check_private_dir
from kvoffload_hal.tiers.mooncake.config import MOONCAKE_KEYS, MooncakeConfig, parse_mooncake

logger = init_logger(__name__)

# A modest default that fits any inference host; production deployments size it
# to the host RAM they can spare for KV (tens to hundreds of GiB).
DEFAULT_CPU_BYTES_TO_USE = 4 << 30


VALID_KEYS = ("cpu_bytes_to_use", "lazy_offload", "disk_path", "disk_bytes_to_use",
              "disk_o_direct", "load_mode", "allow_overcommit", "eviction")
LOAD_MODES = ("auto", "async", "sync")
VALID_KEYS += MOONCAKE_KEYS  # the Mooncake tier's, parsed in tiers/mooncake_config.py


@dataclass(frozen=True)
class OffloadConfig:
    cpu_bytes_to_use: int = DEFAULT_CPU_BYTES_TO_USE
    lazy_offload: bool = False
    disk_path: str | None = None
    disk_bytes_to_use: int = 0
    disk_o_direct: bool = False
    load_mode: str = "auto"
    allow_overcommit: bool = False
    eviction: str = DEFAULT_EVICTION
    mooncake: MooncakeConfig | None = None

    @property
    def disk_enabled(self) -> bool:
        return self.disk_path is not None

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> OffloadConfig:
        mooncake = parse_mooncake(dict(extra or {}))
        return dataclasses.replace(cls._from_core_keys(extra), mooncake=mooncake)

    @classmethod
    def _from_core_keys(cls, extra: dict[str, Any] | None) -> OffloadConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(VALID_KEYS))
        if unknown:
            logger.warning(
                "kv_connector_extra_config: ignoring unknown key(s) %s; valid keys are %s",
                ", ".join(unknown), ", ".join(VALID_KEYS),
            )
        cpu_bytes = positive_int("cpu_bytes_to_use",
                                  extra.get("cpu_bytes_to_use", DEFAULT_CPU_BYTES_TO_USE))
        lazy = boolean("lazy_offload", extra.get("lazy_offload", False))
        o_direct = boolean("disk_o_direct", extra.get("disk_o_direct", False))
        overcommit = boolean("allow_overcommit", extra.get("allow_overcommit", False))
        load_mode = one_of("load_mode", extra.get("load_mode", "auto"), LOAD_MODES)
        eviction = one_of("eviction", extra.get("eviction", DEFAULT_EVICTION),
                          EVICTION_POLICIES)
        disk_path = extra.get("disk_path")
        if disk_path is None:
            for key in ("disk_bytes_to_use", "disk_o_direct"):
                if extra.get(key) not in (None, False):
                    raise ValueError(f"kv_connector_extra_config['{key}'] is set but "
                                     "'disk_path' is not: expected both for a disk tier")
            return cls(cpu_bytes, lazy, disk_o_direct=o_direct, load_mode=load_mode,
                       allow_overcommit=overcommit, eviction=eviction)
        disk_path = _absolute_dir(disk_path)
        if "disk_bytes_to_use" not in extra:
            raise ValueError("kv_connector_extra_config['disk_path'] is set but "
                             "'disk_bytes_to_use' is not: expected an integer number of bytes > 0")
        disk_bytes = positive_int("disk_bytes_to_use", extra["disk_bytes_to_use"])
        _check_writable_dir(disk_path)
        return cls(cpu_bytes, lazy, disk_path, disk_bytes, o_direct, load_mode, overcommit,
                   eviction=eviction)

    def cpu_bytes_per_rank(self, world_size: int) -> int:
        return self.cpu_bytes_to_use // max(1, world_size)


def check_capacity(config: OffloadConfig, world_size: int, *, before_allocating: bool) -> None:
    """Refuse a tier this host cannot hold: one line naming the key, the value and
    what is available, or a warning with ``allow_overcommit``.

    Each rank checks its own share. A worker checks, before allocating, the
    memory available and the free space of ``disk_path`` (ranks starting later
    see what earlier ones took); the scheduler, whose CPU tier index grows with
    the tier, checks the host's total memory.
    """
    ranks = max(1, world_size)
    if before_allocating:
        wanted = [("cpu_bytes_to_use", config.cpu_bytes_per_rank(ranks),
                   host_memory("MemAvailable"), "of memory available")]
        if config.disk_path is not None:
            wanted.append(("disk_bytes_to_use", config.disk_bytes_to_use // ranks,
                           shutil.disk_usage(config.disk_path).free,
                           f"free in {config.disk_path}"))
    else:
        wanted = [("cpu_bytes_to_use", config.cpu_bytes_per_rank(ranks),
                   host_memory("MemTotal"), "of memory on this host")]
    for key, per_rank, available, where in wanted:
        if per_rank <= available:
            continue
        what = (f"kv_connector_extra_config['{key}'] gives {per_rank} bytes per rank "
                f"({_gib(per_rank)}), more than the {_gib(available)} {where}")
        if not config.allow_overcommit:
            raise ValueError(f"{what}: expected at most {available} bytes per rank (or set "
                             "'allow_overcommit': true)")
        logger.warning("%s; accepted since allow_overcommit is set", what)


def host_memory(field: str) -> int:
    """``MemTotal`` or ``MemAvailable`` of ``/proc/meminfo``, in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages = "SC_PHYS_PAGES" if field == "MemTotal" else "SC_AVPHYS_PAGES"
    return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


def device_bytes_per_block(kv_cache_config) -> int:
    """Device KV bytes one block id covers on this rank, over every layer.

    Layers of different HMA groups share tensors (a block id belongs to one
    group at a time), so the count of distinct tensors is the largest group's
    layer count, each holding one page per block id.
    """
    groups = kv_cache_config.kv_cache_groups
    num_tensors = max(len(g.layer_names) for g in groups)
    page_bytes = max(g.kv_cache_spec.page_size_bytes for g in groups)
    return num_tensors * page_bytes


def num_cpu_blocks(kv_cache_config, cpu_bytes_per_rank: int) -> int:
    """Blocks the CPU tier holds: the same for scheduler and worker, from the same inputs."""
    return _num_blocks("cpu_bytes_to_use", kv_cache_config, cpu_bytes_per_rank)


def num_disk_blocks(kv_cache_config, disk_bytes_per_rank: int) -> int:
    """Blocks the disk tier holds per rank."""
    return _num_blocks("disk_bytes_to_use", kv_cache_config, disk_bytes_per_rank)


def _num_blocks(key: str, kv_cache_config, bytes_per_rank: int) -> int:
    per_block = device_bytes_per_block(kv_cache_config)
    if bytes_per_rank < per_block:
        raise ValueError(
            f"kv_connector_extra_config['{key}'] gives {bytes_per_rank} bytes per rank, less "
            f"than one KV block ({per_block} bytes); expected at least {per_block} bytes per rank"
        )
    return bytes_per_rank // per_block


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
    import tempfile

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
