"""What this deployment can do, decided once and read by both connector roles.

Resolved here from the KV cache config, the connector config and the selected
copy backend (registry data: no backend module is imported, no device is touched):

* ``single_group``: the model has one KV cache group. vLLM maps block-level
  load errors back to requests only then (block ids are per group), and
  synchronous loads rely on that mapping.
* ``vllm``: what differs on older vLLM releases, behind one :class:`VllmStrategy`
  (among others, how vLLM learns of a failed load: ``vllm.load_recovery``).
* ``synchronous_compute``: the backend's forward pass has finished when the
  worker submits a step's copies (vLLM's CPU platform), as the HAL states.
* ``sync_loads``: ``load_mode`` resolved; ``tiers``: the names of the secondary
  tiers that run (configured, and accepting this model), nearest first.

**What the connector does differently on older vLLM** is one :class:`VllmStrategy`,
picked by :func:`select_strategy` when the capabilities are resolved; both roles carry
it as ``caps.vllm`` and call its methods, and no other module branches on the release:

* :class:`VllmStrategy`: vLLM >= 0.32, recognised by the connector interface of
  that release (``KVConnectorOutput.failed_recving``, ``has_pending_push_work``,
  ``KVConnectorTransferResults``), detected on vLLM's objects like every other
  difference (:mod:`kvoffload_hal.vllm_compat`). Anything short of all three
  gets the older family, which is safe on a newer vLLM too;
* :class:`OlderVllm`: vLLM 0.23 to 0.31. An idle engine never asks for push work,
  the scheduler stops scanning its waiting queue at the first request it cannot
  allocate, and vLLM is told of failed loads per block only;
* :class:`OlderVllmRetrying`: the same, for a model with several KV cache
  groups, whose failed loads vLLM can be told of neither per block nor per
  request: a failed load is sent again (:attr:`LoadRecovery.RETRY`).

The worker side hands the end of an asynchronous load to :meth:`settle_load`
and :meth:`settle_staged_hit`, which report it through a :class:`LoadSink`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from kvoffload_hal import vllm_compat
from kvoffload_hal.config import OffloadConfig
from kvoffload_hal.hal import registry as backends
from kvoffload_hal.tiers.registry import tier_runs

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput

    from kvoffload_hal.metadata import LoadSpec, OffloadWorkerMetadata

__all__ = ["Capabilities", "LoadFailedError", "LoadRecovery", "LoadSink", "VllmStrategy",
           "resolve_capabilities", "select_strategy", "sleep_refusal"]


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


def sleeps_with_connectors() -> bool:
    """Whether this vLLM offers its sleep mode with a KV connector, and asks the connector
    ``has_pending_block_frees`` (0.33 on): a fact of vLLM's, not of the strategy."""
    return vllm_compat.SLEEP_WITH_CONNECTORS


def loads_before_forward(scheduler_output: Any) -> bool:
    """Whether vLLM's model runner starts the step's loads before its forward pass:
    0.32 on says so per step (``has_sync_kv_loads``); older releases always do."""
    return getattr(scheduler_output, "has_sync_kv_loads", True)


def records_copies(offloading_stats: type) -> bool:
    """Whether this vLLM's ``OffloadingConnectorStats`` keeps a record per copy
    (``record_transfer``), which the GPU benchmark's meter reads."""
    return hasattr(offloading_stats, "record_transfer")


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


class LoadRecovery(Enum):
    """How vLLM is kept from reading the blocks of a failed load (the value says it)."""

    BLOCKS = "the device blocks that failed are reported; vLLM recomputes from the first"
    REQUESTS = "the request is reported failed (KVConnectorOutput.failed_recving)"
    # vLLM < 0.32 with several groups: its invalid-block path reads one group
    # per request, and rewinding a request to its valid tokens is not safe
    # (vLLM releases sliding-window and Mamba blocks behind the tokens it
    # counts as computed), so the copy is tried again.
    RETRY = ("the copy is tried again from the CPU blocks it holds; if it fails again the "
             "engine stops with an error, before any block is read")


class LoadFailedError(RuntimeError):
    """A load failed where this vLLM cannot recompute it (``LoadRecovery.RETRY``)."""


class LoadSink(Protocol):
    """Where a worker collects its load results (``worker.loads.LoadOutcomes``)."""

    def finish(self, req_ids: Iterable[str]) -> None:
        """Report the requests in ``finished_recving``."""

    def finish_once(self, req_ids: Iterable[str]) -> None:
        """Report those of the requests this rank has not reported yet."""

    def fail_blocks(self, gpu_blocks: Iterable[int]) -> None:
        """Report the device blocks as load errors (vLLM recomputes from the first)."""

    def fail_requests(self, req_ids: Iterable[str]) -> None:
        """Report the requests failed (``failed_recving``)."""


class VllmStrategy:
    """vLLM >= 0.32. ``num_groups``: the model's KV cache groups."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.single_group = num_groups == 1

    @property
    def load_recovery(self) -> LoadRecovery:
        """How vLLM learns of a failed load (block ids are per group: one group only)."""
        return LoadRecovery.BLOCKS if self.single_group else LoadRecovery.REQUESTS

    # ------------------------------------------------------------ worker side
    def settle_load(self, sink: LoadSink, load: LoadSpec, ok: bool,
                    reports: OffloadWorkerMetadata) -> None:
        """An asynchronous load ended on this rank: it is reported finished even when it
        failed, so its requests leave the waiting state, and a failure is reported."""
        sink.finish(load.req_ids)
        if not ok:
            self.report_failure(sink, load.req_ids, load.gpu_blocks, reports)

    def settle_staged_hit(self, sink: LoadSink, req_id: str, unfilled: list[int],
                          reports: OffloadWorkerMetadata) -> None:
        """The last round of a staged hit ended on this rank; ``unfilled``: the device
        blocks that a failed round or a block no round read left unfilled."""
        sink.finish((req_id,))
        if unfilled:
            self.report_failure(sink, (req_id,), unfilled, reports)

    def report_failure(self, sink: LoadSink, req_ids: tuple[str, ...], gpu_blocks: list[int],
                       reports: OffloadWorkerMetadata) -> None:
        """Per block for one group; per request (and to the scheduler side) for more."""
        if self.single_group:
            sink.fail_blocks(gpu_blocks)
        else:
            sink.fail_requests(req_ids)
            reports.failed_loads.update(req_ids)

    # --------------------------------------------------------- scheduler side
    def failed_recving(self, output: KVConnectorOutput) -> set[str]:
        """Requests whose asynchronous load failed, as vLLM collected them from the workers."""
        return vllm_compat.failed_recving(output)

    def on_failed_loads(self, req_ids: set[str], send_again: Callable[[set[str]], None],
                        recompute: Callable[[set[str]], None]) -> None:
        """Requests a rank reported failed in its worker metadata (``failed_loads``):
        ``recompute`` them (vLLM is told), or ``send_again`` their copies (withheld
        from vLLM: :attr:`LoadRecovery.RETRY`)."""
        recompute(req_ids)

    def checks_staged_hits_first(self) -> bool:
        """Whether a staged hit's tier blocks are read and checked before it is offered
        (only where a failed last round could not be recomputed)."""
        return False

    def recovery_notice(self) -> str | None:
        """A line to log once at start-up where failed loads are neither reported per
        block nor per request (the engine may stop), else None."""
        return None

    def reads_failed_loads_again(self) -> bool:
        """Whether a failed load is sent again from the CPU blocks it read (then no rescue
        may take those blocks in its step: scheduler/hand_over.py)."""
        return False

    def tracks_landed_loads(self) -> bool:
        """Whether the scheduler must keep vLLM's scan of the waiting queue going until a
        request whose asynchronous load landed is picked up. vLLM 0.32 scans the waiting
        requests that hold KV blocks first; older releases stop at the first request
        they cannot allocate, which may come before it."""
        return not vllm_compat.block_holders_first()

    def holds_last_request(self) -> bool:
        """Whether an idle engine steps for the last writes only while a finished request's
        blocks are held (older vLLM never asks ``has_pending_push_work``)."""
        return False

    def hit_source(self) -> Any:
        """What vLLM counts the connector's hits as (host memory; None where it does not
        count hits by source)."""
        return vllm_compat.HOST_HIT_SOURCE


class OlderVllm(VllmStrategy):
    """vLLM 0.23 to 0.31, a model with one KV cache group."""

    def failed_recving(self, output: KVConnectorOutput) -> set[str]:
        return set()

    def tracks_landed_loads(self) -> bool:
        return True

    def holds_last_request(self) -> bool:
        return True

    def hit_source(self) -> Any:
        return None


class OlderVllmRetrying(OlderVllm):
    """vLLM 0.23 to 0.31, a model with several KV cache groups: its invalid-block path
    reads one group per request and it has no per-request report, so a failed load
    is withheld from vLLM and sent again; a staged hit is checked before it is offered,
    and a last round that still fails stops the engine before its blocks are read."""

    @property
    def load_recovery(self) -> LoadRecovery:
        return LoadRecovery.RETRY

    def settle_load(self, sink: LoadSink, load: LoadSpec, ok: bool,
                    reports: OffloadWorkerMetadata) -> None:
        """A failed attempt goes to the scheduler side, which sends it again; a request
        this rank reported finished is not reported again (vLLM counts one report per
        rank) when another rank's failure brings its load back."""
        if not ok:
            reports.failed_loads.update(load.req_ids)
            return
        sink.finish_once(load.req_ids)

    def settle_staged_hit(self, sink: LoadSink, req_id: str, unfilled: list[int],
                          reports: OffloadWorkerMetadata) -> None:
        if unfilled:
            # The hit was checked (scheduler/secondary/staged_check.py) and its last copy
            # still failed: this vLLM would read the blocks, it cannot recompute them.
            raise LoadFailedError(
                f"HALOffloadConnector: the last copy of request {req_id}'s staged KV hit "
                f"failed ({len(unfilled)} device blocks unfilled), and this vLLM cannot "
                "recompute a failed load of this model (several KV cache groups); stopping "
                "before its blocks are read. vLLM >= 0.32 recomputes instead")
        sink.finish((req_id,))

    def on_failed_loads(self, req_ids: set[str], send_again: Callable[[set[str]], None],
                        recompute: Callable[[set[str]], None]) -> None:
        send_again(req_ids)

    def checks_staged_hits_first(self) -> bool:
        return True

    def reads_failed_loads_again(self) -> bool:
        return True

    def recovery_notice(self) -> str | None:
        return ("HALOffloadConnector: this vLLM takes failed KV loads per block for one KV "
                "cache group only (no KVConnectorOutput.failed_recving); for this model's "
                f"{self.num_groups} groups, on a failed load {self.load_recovery.value}. "
                "vLLM >= 0.32 recomputes instead; so does --disable-hybrid-kv-cache-manager "
                "for sliding-window models (one group)")


def select_strategy(num_groups: int) -> VllmStrategy:
    """The strategy for this vLLM and a model with ``num_groups`` KV cache groups."""
    if (vllm_compat.REPORTS_FAILED_RECVING and vllm_compat.STEPS_FOR_PUSH_WORK
            and vllm_compat.HAS_TRANSFER_RESULTS):
        return VllmStrategy(num_groups)
    return OlderVllm(num_groups) if num_groups == 1 else OlderVllmRetrying(num_groups)
