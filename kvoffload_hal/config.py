"""Connector configuration, read from ``kv_transfer_config.kv_connector_extra_config``.

======================  ==========  =================================================
key                     default     meaning
======================  ==========  =================================================
``cpu_bytes_to_use``    4 GiB       host memory of the CPU tier for the whole
                                    instance, split evenly across TP x PP ranks
                                    (int bytes > 0)
``lazy_offload``        ``false``   ``false``: store every full block once computed
                                    (eager); ``true``: store only the device blocks
                                    next in line for eviction (lazy)
``allow_overcommit``    ``false``   accept a rank's share of ``cpu_bytes_to_use``
                                    larger than the memory available when it
                                    starts, or a secondary tier larger than the
                                    room it finds (``disk_bytes_to_use`` beyond the
                                    free space of ``disk_path``); refused
                                    otherwise, before anything is allocated
``load_mode``           ``auto``    ``sync``: a CPU hit is loaded before the forward
                                    pass of the step that schedules the request;
                                    ``async``: the request waits for its load over
                                    one or more steps; ``auto``: ``sync`` where the
                                    copy backend's compute is synchronous (vLLM's
                                    CPU platform) with one KV cache group, else
                                    ``async``
``eviction``            adaptive    order in which the CPU tier evicts: ``lru``
                                    (vLLM's ``BlockPool`` order) or ``adaptive``
                                    (each released block to the head or the tail
                                    of that order by what happened to it since it
                                    was stored, as the best of four candidate
                                    insertions on sampled shadows says; see
                                    ``eviction/adaptive.py``), or a plug-in
                                    policy's name (``eviction/registry.py``)
``device_copies``       ``keep``    CPU-tier copies of blocks the device also
                                    holds: ``keep``: ranked like any other block
                                    (the tiers are inclusive); ``drop``: evicted
                                    before any block only the CPU tier holds, and
                                    copied back (rescued) when the device reuses
                                    the block (scheduler/device_copies.py)
``prefetch_requests``   4           with a secondary tier: how many of the oldest
                                    waiting requests not yet looked up by vLLM's
                                    scheduler have their tier blocks promoted into
                                    the CPU tier ahead of admission (int >= 0; 0:
                                    off)
``prefetch_cpu_share``  0.25        the most of the CPU tier (share of its blocks,
                                    in (0, 1]) that prefetched requests hold
                                    pinned: blocks being promoted, promoted, and
                                    the CPU hits they extend
``prefetch_blocks``     0           the same cap in blocks (int >= 0; 0: only the
                                    share applies); the smaller cap wins
``shutdown_flush_       2.0         longest an engine with no request left keeps
timeout_s``                         stepping for its last stores and tier writes
                                    (after its last request finished, also when it
                                    stops), and, again, longest the workers wait at
                                    shutdown for tier writes still running; writes
                                    unfinished then are dropped whole (seconds >= 0)
``defer_loads_without_  ``false``   a CPU-tier hit waits (vLLM asks again next
room``                              step) while the device's free blocks, less its
                                    prompt's, would not cover the blocks the
                                    running requests start next step: admitted,
                                    vLLM would preempt it then (models with one KV
                                    cache group; ``scheduler/admission.py``)
======================  ==========  =================================================

Each secondary tier owns its keys and documents them: the disk tier
(``disk_path``, ``disk_bytes_to_use``, ``disk_o_direct``) in
:mod:`kvoffload_hal.tiers.disk`, the Mooncake tier (``mooncake_*``) in
:mod:`kvoffload_hal.tiers.mooncake.config`. Every tier turned on runs, in a chain behind
the CPU tier, nearest first: ``tiers`` (a list of tier names) gives the order, by
default tiers only this instance writes before tiers shared across instances
(:func:`kvoffload_hal.tiers.registry.parse_tiers`).

Validated once at start-up: a wrong type or range raises ``ValueError`` naming the
key, the value and what was expected; unknown keys give one warning listing the
valid keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvoffload_hal.config_values import (
    boolean,
    count,
    one_of,
    positive_int,
    seconds,
    share,
    whole_blocks,
)
from kvoffload_hal.eviction.registry import (
    DEFAULT_DEVICE_COPIES,
    DEFAULT_EVICTION,
    DEVICE_COPY_MODES,
    eviction_names,
)
from kvoffload_hal.host_memory import host_memory
from kvoffload_hal.logger import init_logger
from kvoffload_hal.tiers.registry import parse_tiers, tier_keys
from kvoffload_hal.tiers.spec import CapacityClaim, TierSpec

logger = init_logger(__name__)

# A modest default that fits any inference host; production deployments size it
# to the host RAM they can spare for KV (tens to hundreds of GiB).
DEFAULT_CPU_BYTES_TO_USE = 4 << 30
# vLLM admits waiting requests in arrival order as running ones finish, a few per
# step at most: the next 4 are the ones a promotion started now can still get ready
# for (a disk read of a long document takes several steps). Looking further ahead
# pins CPU blocks for requests that run much later; the share keeps 3/4 of the CPU
# tier for the hits, loads and stores of the requests that run.
DEFAULT_PREFETCH_REQUESTS = 4
DEFAULT_PREFETCH_CPU_SHARE = 0.25
# vLLM gives an engine core it stops 5 s (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS) before it
# kills it: the last steps' writes and the workers' wait for them, 2 s each at most, fit.
DEFAULT_SHUTDOWN_FLUSH_TIMEOUT_S = 2.0


CORE_KEYS = ("cpu_bytes_to_use", "lazy_offload", "load_mode", "allow_overcommit", "eviction",
             "device_copies", "prefetch_requests", "prefetch_cpu_share", "prefetch_blocks",
             "shutdown_flush_timeout_s", "defer_loads_without_room")
LOAD_MODES = ("auto", "async", "sync")


@dataclass(frozen=True)
class OffloadConfig:
    cpu_bytes_to_use: int = DEFAULT_CPU_BYTES_TO_USE
    lazy_offload: bool = False
    load_mode: str = "auto"
    allow_overcommit: bool = False
    eviction: str = DEFAULT_EVICTION
    device_copies: str = DEFAULT_DEVICE_COPIES
    prefetch_requests: int = DEFAULT_PREFETCH_REQUESTS
    prefetch_cpu_share: float = DEFAULT_PREFETCH_CPU_SHARE
    prefetch_blocks: int = 0  # 0: the share alone caps what prefetched requests hold
    shutdown_flush_timeout_s: float = DEFAULT_SHUTDOWN_FLUSH_TIMEOUT_S
    defer_loads_without_room: bool = False
    tiers: tuple[TierSpec, ...] = ()  # the secondary tiers behind the CPU tier, nearest first

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> OffloadConfig:
        extra = dict(extra or {})
        valid = CORE_KEYS + tier_keys()
        unknown = sorted(set(extra) - set(valid))
        if unknown:
            logger.warning(
                "kv_connector_extra_config: ignoring unknown key(s) %s; valid keys are %s",
                ", ".join(unknown), ", ".join(valid),
            )
        return cls(
            cpu_bytes_to_use=positive_int(
                "cpu_bytes_to_use", extra.get("cpu_bytes_to_use", DEFAULT_CPU_BYTES_TO_USE)),
            lazy_offload=boolean("lazy_offload", extra.get("lazy_offload", False)),
            load_mode=one_of("load_mode", extra.get("load_mode", "auto"), LOAD_MODES),
            allow_overcommit=boolean("allow_overcommit", extra.get("allow_overcommit", False)),
            eviction=one_of("eviction", extra.get("eviction", DEFAULT_EVICTION),
                            eviction_names()),
            device_copies=one_of("device_copies", extra.get(
                "device_copies", DEFAULT_DEVICE_COPIES), DEVICE_COPY_MODES),
            prefetch_requests=count("prefetch_requests", extra.get(
                "prefetch_requests", DEFAULT_PREFETCH_REQUESTS), "requests"),
            prefetch_cpu_share=share("prefetch_cpu_share", extra.get(
                "prefetch_cpu_share", DEFAULT_PREFETCH_CPU_SHARE)),
            prefetch_blocks=count("prefetch_blocks", extra.get("prefetch_blocks", 0), "blocks"),
            shutdown_flush_timeout_s=seconds("shutdown_flush_timeout_s", extra.get(
                "shutdown_flush_timeout_s", DEFAULT_SHUTDOWN_FLUSH_TIMEOUT_S)),
            defer_loads_without_room=boolean("defer_loads_without_room", extra.get(
                "defer_loads_without_room", False)),
            tiers=parse_tiers(extra),
        )

    def cpu_bytes_per_rank(self, world_size: int) -> int:
        return self.cpu_bytes_to_use // max(1, world_size)


def check_capacity(config: OffloadConfig, world_size: int, *, before_allocating: bool) -> None:
    """Refuse a tier this host cannot hold: one line naming the key, the value and
    what is available, or a warning with ``allow_overcommit``.

    Each rank checks its own share. A worker checks, before allocating, the
    memory available and the room its secondary tier claims (ranks starting
    later see what earlier ones took); the scheduler, whose CPU tier index grows with
    the tier, checks the host's total memory.
    """
    ranks = max(1, world_size)
    if before_allocating:
        wanted = [CapacityClaim("cpu_bytes_to_use", config.cpu_bytes_per_rank(ranks),
                                host_memory("MemAvailable"), "of memory available")]
        for tier in config.tiers:
            wanted += tier.capacity_claims(ranks)
    else:
        wanted = [CapacityClaim("cpu_bytes_to_use", config.cpu_bytes_per_rank(ranks),
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


def local_replicas(parallel_config) -> int:
    """Data-parallel ranks of this server on this host that this rank knows of.

    vLLM keeps ``data_parallel_size_local`` for ranks that run in lockstep (MoE
    models). It runs the ranks of a dense model as independent engines and tells
    each it is alone, but leaves it its local index: rank ``i`` then knows of
    ranks ``0..i``, and the last local rank of them all.
    """
    size = parallel_config.data_parallel_size_local or 1
    return max(size, (parallel_config.data_parallel_rank_local or 0) + 1)


def check_replicas(config: OffloadConfig, replicas: int, available: int) -> None:
    """Refuse CPU tiers of ``replicas`` data-parallel ranks that overcommit the host together.

    Each rank holds ``cpu_bytes_to_use`` (one server's ranks start together, so
    each checking only its own tier would let them overcommit the host):
    their sum must fit in ``available``, the memory available as the ranks
    started (before any of them allocated). One line naming the key, the count
    and the figures; a warning with ``allow_overcommit``.
    """
    total = replicas * config.cpu_bytes_to_use
    if replicas <= 1 or total <= available:
        return
    what = (f"kv_connector_extra_config['cpu_bytes_to_use'] gives each of {replicas} "
            f"data-parallel ranks on this host {config.cpu_bytes_to_use} bytes "
            f"({_gib(total)} in all), more than the {_gib(available)} of memory available "
            "as they started")
    if not config.allow_overcommit:
        raise ValueError(f"{what}: expected at most {available // replicas} bytes per "
                         "data-parallel rank (or set 'allow_overcommit': true)")
    logger.warning("%s; accepted since allow_overcommit is set", what)


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
    return num_blocks_for("cpu_bytes_to_use", kv_cache_config, cpu_bytes_per_rank)


def num_blocks_for(key: str, kv_cache_config, bytes_per_rank: int) -> int:
    return whole_blocks(key, bytes_per_rank, device_bytes_per_block(kv_cache_config))
