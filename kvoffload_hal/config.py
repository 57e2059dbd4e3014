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
=====================  ==========  =================================================

Validated once at start-up: a wrong type or range raises ``ValueError`` naming the
key, the value and what was expected; unknown keys give one warning listing the
valid keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvoffload_hal.logger import init_logger

logger = init_logger(__name__)

# A modest default that fits any inference host; production deployments size it
# to the host RAM they can spare for KV (tens to hundreds of GiB).
DEFAULT_CPU_BYTES_TO_USE = 4 << 30


@dataclass(frozen=True)
class OffloadConfig:
    cpu_bytes_to_use: int = DEFAULT_CPU_BYTES_TO_USE
    lazy_offload: bool = False

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "OffloadConfig":
        extra = dict(extra or {})
        valid = ("cpu_bytes_to_use", "lazy_offload")
        unknown = sorted(set(extra) - set(valid))
        if unknown:
            logger.warning(
                "kv_connector_extra_config: ignoring unknown key(s) %s; valid keys are %s",
                ", ".join(unknown), ", ".join(valid),
            )
        cpu_bytes = extra.get("cpu_bytes_to_use", DEFAULT_CPU_BYTES_TO_USE)
        if isinstance(cpu_bytes, bool) or not isinstance(cpu_bytes, int) or cpu_bytes <= 0:
            raise ValueError(
                f"kv_connector_extra_config['cpu_bytes_to_use']={cpu_bytes!r}: "
                "expected an integer number of bytes > 0"
            )
        lazy = extra.get("lazy_offload", False)
        if not isinstance(lazy, bool):
            raise ValueError(
                f"kv_connector_extra_config['lazy_offload']={lazy!r}: expected true or false"
            )
        return cls(cpu_bytes_to_use=cpu_bytes, lazy_offload=lazy)

    def cpu_bytes_per_rank(self, world_size: int) -> int:
        return self.cpu_bytes_to_use // max(1, world_size)


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
    per_block = device_bytes_per_block(kv_cache_config)
    n = cpu_bytes_per_rank // per_block
    if n < 1:
        raise ValueError(
            f"kv_connector_extra_config['cpu_bytes_to_use'] gives {cpu_bytes_per_rank} bytes "
            f"per rank, less than one KV block ({per_block} bytes); expected at least "
            f"{per_block} bytes per rank"
        )
    return n
