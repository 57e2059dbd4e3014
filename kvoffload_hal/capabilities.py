"""What this deployment can do, decided once and read by both connector roles.

Resolved here from the KV cache config, the connector config and the selected
copy backend (registry data: no backend module is imported, no device is touched):

* ``single_group``: the model has one KV cache group. vLLM maps block-level
  load errors back to requests only then (block ids are per group), and
  synchronous loads rely on that mapping.
* ``vllm``: what differs on older vLLM releases, behind one
  :class:`~kvoffload_hal.vllm_strategy.VllmStrategy` (among others, how vLLM
  learns of a failed load: ``vllm.load_recovery``).
* ``synchronous_compute``: the backend's forward pass has finished when the
  worker submits a step's copies (vLLM's CPU platform), as the HAL states.
* ``sync_loads``: ``load_mode`` resolved; ``tiers``: the names of the secondary
  tiers that run (configured, and accepting this model), nearest first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffload_hal.config import OffloadConfig
from kvoffload_hal.hal import registry as backends
from kvoffload_hal.tiers.registry import tier_runs
from kvoffload_hal.vllm_strategy import (
    LoadFailedError,
    LoadRecovery,
    VllmStrategy,
    select_strategy,
)

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

# LoadRecovery and LoadFailedError are imported from here as well.
__all__ = ["Capabilities", "LoadFailedError", "LoadRecovery", "resolve_capabilities",
           "sleep_refusal"]


@dataclass(frozen=True)
class Capabilities:
    single_group: bool
    synchronous_compute: bool
    sync_loads: bool
    vllm: VllmStrategy
    tiers: tuple[str, ...] = ()

    @property
    def secondary_tier(self) -> bool:
        """A tier behind the CPU tier runs."""
        return bool(self.tiers)

    @property
    def load_recovery(self) -> LoadRecovery:
        """How vLLM learns of a failed load (``vllm.load_recovery``)."""
        return self.vllm.load_recovery


def resolve_capabilities(kv_cache_config: KVCacheConfig, config: OffloadConfig,
                         backend: str | None = None) -> Capabilities:
    """``backend``: a ``KVOFFLOAD_HAL_BACKEND`` value (default: the variable's)."""
    num_groups = len(kv_cache_config.kv_cache_groups)
    single_group = num_groups == 1
    synchronous_compute = backends.synchronous_compute(backend)
    if config.load_mode == "sync" and not single_group:
        raise ValueError(
            f"kv_connector_extra_config['load_mode']='sync': expected a model with one KV "
            f"cache group, this one has {num_groups}; use 'async' or 'auto'")
    if config.load_mode == "auto":
        # Where compute is synchronous the forward pass cannot overlap a copy anyway.
        sync_loads = synchronous_compute and single_group
    else:
        sync_loads = config.load_mode == "sync"
    tiers = tuple(spec.name for spec in config.tiers if tier_runs(spec, kv_cache_config))
    return Capabilities(single_group, synchronous_compute, sync_loads,
                        select_strategy(num_groups), tiers=tiers)


def sleep_refusal(config: OffloadConfig) -> str | None:
    """None where vLLM's sleep mode is safe with ``config``, else why not (one line).

    A sleep resets the connector's cache (vLLM calls ``reset_cache`` before it
    frees the KV cache), because weights may change before the wake-up: the CPU
    and disk tiers forget every block. A tier shared with other instances keeps
    its objects, named by the weight files and not by the weights in memory, so
    blocks computed before a weight update would be served after it.
    """
    shared = [tier for tier in config.tiers if tier.shared_across_instances]
    if shared:
        return (f"HALOffloadConnector refuses sleep mode with the {shared[0].display_name()}: "
                f"other instances share its blocks, whose keys name the weight files, not "
                f"the weights a sleep may replace; use the CPU or disk tier")
    return None
