"""Every difference between the vLLM releases this package supports, in one place.

Supported: vLLM 0.23 (the release the latest stable vllm-ascend runs on) to
0.33. Each difference is detected on the objects themselves (a field, an
attribute, a parameter), never from a version string: vllm-ascend and other
builds patch vLLM at run time, and a feature check follows what is really there.
The helpers here smooth over differences of API shape (the same thing, reached
another way). Where the connector must *behave* differently on older vLLM (how a
failed load is recovered, whether the last request is held for the last writes,
whether landed loads are tracked), :mod:`kvoffload_hal.capabilities` (its ``VllmStrategy``) decides,
once per model, from the flags below; the rest of the package calls the strategy
(``caps.vllm``) and these helpers, and tests no release itself.

=================================  ==================  ===============================
what                               missing before      here
=================================  ==================  ===============================
``KVConnectorTransferResults``,    0.32                :func:`transfer_results`; older
``get_transfer_results``                               releases call ``get_finished``
``KVConnectorOutput                0.32                :data:`REPORTS_FAILED_RECVING`;
.failed_recving``                                      without it a failed load can be
                                                       reported per block for one KV
                                                       cache group only; with more,
                                                       a failed load is sent again
                                                       (``capabilities``)
``get_kv_cache_coordinator``       (changed)           :func:`make_coordinator` passes
keyword arguments                                      the arguments the factory names
``find_longest_cache_hit``         (2 values, not 3)   :func:`find_longest_cache_hit`
``coordinator.group_block_sizes``  0.32                :func:`group_block_sizes`
``KVCacheConfig                    0.32                :func:`prefix_cacheable_group_ids`
.prefix_cacheable_group_ids``
``BlockPool._insert_block_hash``   0.32                :func:`insert_block_hashes`
``MEDIUM_CPU``, ``BlockPool        0.32                :data:`MEDIUM_CPU`,
.medium``, ``BlockStored                               :func:`block_stored`,
(locality=)``                                          :func:`label_pool`
``FreeKVCacheBlockQueue            0.32                :func:`iter_free_blocks`
.iter_blocks_after``
``get_kv_cache_configs``           (0.33: moved; the   :func:`get_kv_cache_configs`
                                   model's groups      (benchmarks)
                                   planned first)
``CacheHitSource`` (hits counted   0.32                :data:`HOST_HIT_SOURCE`: the
by source)                                             connector's hits count as host
``has_pending_push_work``          0.32 (never         :data:`STEPS_FOR_PUSH_WORK`:
                                   called before)      before, the last request is held
                                                       for the last writes
                                                       (``exit_flush``, ``capabilities``)
``Scheduler._holds_kv_blocks``     0.32                :func:`block_holders_first`:
(requests holding blocks first)                        before, landed loads are tracked
                                                       (``capabilities``)
``has_positionally_stable_blocks``  0.32                :func:`positionally_stable`:
(Mamba 'align' state)                                  older managers keep a block per
                                                       position
``CacheConfig                      (build-dependent)   :func:`prefix_caching_hash_algo`
.prefix_caching_hash_algo``
sleep mode with connectors         0.33                :data:`SLEEP_WITH_CONNECTORS`;
(``unregister_kv_caches``,                             before, vLLM never calls them
``restore_kv_caches``),
``finish_forward``,
``has_pending_block_frees``,
``requires_kv_delivery``
``SpeculativeConfig                0.32                :func:`drops_trailing_block`;
.use_eagle_block_drop``                                older: ``use_eagle()``
=================================  ==================  ===============================

vLLM 0.33's other connector hooks are left at vLLM's defaults, each for a reason
given in docs/design.md ("vLLM releases").
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import TYPE_CHECKING, Any

from vllm.distributed import kv_events
from vllm.distributed.kv_transfer.kv_connector.v1 import base as connector_base
from vllm.v1.core import kv_cache_coordinator
from vllm.v1.outputs import KVConnectorOutput

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
    from vllm.v1.kv_cache_interface import KVCacheConfig

MEDIUM_CPU: str = getattr(kv_events, "MEDIUM_CPU", "CPU")
_TransferResults = getattr(connector_base, "KVConnectorTransferResults", None)
HAS_TRANSFER_RESULTS: bool = _TransferResults is not None
# Whether an idle engine keeps stepping while the connector has push work.
STEPS_FOR_PUSH_WORK: bool = hasattr(connector_base.KVConnectorBase_V1, "has_pending_push_work")
# vLLM 0.32 drains waiting requests that hold KV blocks before the others; before,
# its scan of the waiting queue stopped at the first request it could not allocate,
# so a request whose asynchronous load landed behind that one was not picked up.
@functools.cache
def vllm_release() -> tuple[int, int]:
    """The installed vLLM's (major, minor): for tests and benchmarks that run on some
    releases only, or name their outputs by release."""
    import vllm

    major, minor = vllm.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def vllm_tag() -> str:
    """The installed vLLM's release without dots or local part (``0320`` for 0.32.0)."""
    import vllm

    return vllm.__version__.split("+")[0].replace(".", "")


def block_holders_first() -> bool:
    scheduler = importlib.import_module("vllm.v1.core.sched.scheduler")  # at use: no cycle
    return hasattr(scheduler.Scheduler, "_holds_kv_blocks")


# vLLM 0.33: sleep mode with a connector (and the hooks that came with it:
# finish_forward, has_pending_block_frees, requires_kv_delivery).
SLEEP_WITH_CONNECTORS: bool = hasattr(connector_base.KVConnectorBase_V1, "restore_kv_caches")
REPORTS_FAILED_RECVING: bool = "failed_recving" in getattr(
    KVConnectorOutput, "__dataclass_fields__", {})
_BLOCK_STORED_FIELDS = frozenset(getattr(kv_events.BlockStored, "__struct_fields__", ()))
try:  # where vLLM counts prefix-cache hits by the tier that supplied them
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    HOST_HIT_SOURCE: Any = CacheHitSource.HOST
except ImportError:
    HOST_HIT_SOURCE = None


# ---------------------------------------------------------------- connector
def failed_recving(output: KVConnectorOutput) -> set[str]:
    """Requests whose asynchronous load failed, as vLLM collected them (empty before 0.32)."""
    return getattr(output, "failed_recving", None) or set()


def prefix_caching_hash_algo(vllm_config: VllmConfig) -> str | None:
    """The block-hash algorithm of vLLM's prefix cache, where the build names one."""
    return getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None)


def positionally_stable(manager: Any) -> bool:
    """A KV cache group's manager keeps one block per position for a request's lifetime
    (False for Mamba state in 'align' mode, which replaces it as the request runs)."""
    return getattr(manager, "has_positionally_stable_blocks", True)


# ------------------------------------------------- as vLLM's model runner calls a connector
def connector_output(failed_recving: set[str], **fields: Any) -> KVConnectorOutput:
    """A ``KVConnectorOutput`` as this release's model runner builds it: with the failed
    loads where the release has the field."""
    if REPORTS_FAILED_RECVING:
        fields["failed_recving"] = failed_recving
    return KVConnectorOutput(**fields)


def ask_transfer_results(connector: Any, finished: set[str]) -> tuple[set, set, set]:
    """(finished sending, finished receiving, failed receiving), as this release's model
    runner asks a worker-side connector for them."""
    if HAS_TRANSFER_RESULTS:
        results = connector.get_transfer_results(finished)
        return (results.finished_sending or set(), results.finished_recving,
                results.failed_recving)
    sending, recving = connector.get_finished(finished)
    return sending or set(), recving or set(), set()


def end_forward(connectors: Iterable[Any]) -> None:
    """The forward pass is enqueued: the releases whose runner says so (with sleep mode
    for connectors, 0.33) call ``finish_forward``."""
    if SLEEP_WITH_CONNECTORS:
        for connector in connectors:
            connector.finish_forward()


def nudge_idle_engine(add_request: Callable[[], None]) -> None:
    """An idle engine of a release that does not step for a connector's push work steps
    only for a request: ``add_request`` gives it one."""
    if not STEPS_FOR_PUSH_WORK:
        add_request()


def transfer_results(sending: set[str], recving: set[str], failed: set[str]) -> Any:
    """The value of ``get_transfer_results`` (only releases that have the type call it)."""
    if _TransferResults is None:
        raise RuntimeError("this vLLM has no KVConnectorTransferResults; it calls get_finished")
    return _TransferResults(sending, recving, failed)


# -------------------------------------------------------------- coordinator
def drops_trailing_block(vllm_config: VllmConfig) -> bool:
    """Whether vLLM drops the last block of a prefix-cache hit, as it does for drafters
    fed the target's hidden states (EAGLE, MTP): their KV at a block's last position
    was computed with the token that followed it, which another request may not
    share. The CPU tier's hits follow the same rule (``use_eagle`` of the coordinator).
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return False
    rule = getattr(spec, "use_eagle_block_drop", None) or spec.use_eagle
    return bool(rule())


def make_coordinator(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *,
                     block_size: int, hash_block_size: int,
                     enable_kv_cache_events: bool) -> Any:
    """A prefix-caching ``KVCacheCoordinator`` over ``kv_cache_config``.

    The factory is looked up through its module at call time (vllm-ascend
    replaces it) and given the keyword arguments it names: releases differ in
    ``max_in_flight_tokens``/``max_num_batched_tokens``, ``scheduler_block_size``
    and ``allow_partial_hash_hits`` (where missing, hits already end on a block).
    """
    factory = kv_cache_coordinator.get_kv_cache_coordinator
    batched = vllm_config.scheduler_config.max_num_batched_tokens
    offered = dict(
        kv_cache_config=kv_cache_config,
        max_model_len=vllm_config.model_config.max_model_len,
        max_in_flight_tokens=getattr(vllm_config, "max_in_flight_tokens", batched),
        max_num_batched_tokens=batched,
        use_eagle=drops_trailing_block(vllm_config),
        enable_caching=True,
        enable_kv_cache_events=enable_kv_cache_events,
        dcp_world_size=vllm_config.parallel_config.decode_context_parallel_size,
        pcp_world_size=1,
        scheduler_block_size=block_size,
        hash_block_size=hash_block_size,
        # Copies are whole blocks, so hits must end on a block boundary.
        allow_partial_hash_hits=False,
    )
    accepted = inspect.signature(factory).parameters
    return factory(**{k: v for k, v in offered.items() if k in accepted})


def find_longest_cache_hit(coordinator: Any, block_hashes: Sequence[Any],
                           max_tokens: int) -> tuple[Any, int]:
    """``(blocks per group, tokens)``; newer releases return a third value, unused here."""
    found = coordinator.find_longest_cache_hit(block_hashes, max_tokens)
    return found[0], found[1]


class _MapWith:
    """A pool's hash map, extended: ``more(hash with group id)`` answers what it lacks."""

    def __init__(self, base: Any, more: Callable[[Any], Any]) -> None:
        self._base, self._more = base, more

    def get_one_block(self, key: Any) -> Any:
        return self._base.get_one_block(key) or self._more(key)


def find_longest_cache_hit_with(coordinator: Any, block_hashes: Sequence[Any],
                                max_tokens: int, more: Callable[[Any], Any]) -> tuple[Any, int]:
    """:func:`find_longest_cache_hit` over the pool's cached blocks and, for a hash it
    lacks, what ``more`` answers (a stand-in, or None): vLLM's own rules decide the hit
    (each group's: a window's last blocks, a Mamba state at the hit's end). Every
    release's lookup reads the pool's map through ``get_one_block`` only; the map is
    put back before this returns, and nothing else runs meanwhile."""
    pool = coordinator.block_pool
    base = pool.cached_block_hash_to_block
    pool.cached_block_hash_to_block = _MapWith(base, more)
    try:
        return find_longest_cache_hit(coordinator, block_hashes, max_tokens)
    finally:
        pool.cached_block_hash_to_block = base


def group_block_sizes(coordinator: Any) -> tuple[int, ...]:
    sizes = getattr(coordinator, "group_block_sizes", None)
    if sizes is None:
        sizes = [manager.block_size for manager in coordinator.single_type_managers]
    return tuple(sizes)


def prefix_cacheable_group_ids(kv_cache_config: KVCacheConfig) -> tuple[int, ...]:
    ids = getattr(kv_cache_config, "prefix_cacheable_group_ids", None)
    if ids is None:  # every group is prefix-cached (only one is supported there)
        ids = range(len(kv_cache_config.kv_cache_groups))
    return tuple(ids)


# ---------------------------------------------------------------- block pool
def insert_block_hashes(pool: BlockPool, blocks: Sequence[KVCacheBlock],
                        block_hashes: Sequence[Any]) -> None:
    """Make each of ``blocks`` findable under its hash in ``pool``'s prefix cache."""
    insert = getattr(pool, "_insert_block_hash", None)
    if insert is not None:
        for block, block_hash in zip(blocks, block_hashes):
            insert(block_hash, block, None)
        return
    # One hash per block, as that release's own cache_full_blocks does it.
    cache = pool.cached_block_hash_to_block
    for block, block_hash in zip(blocks, block_hashes):
        block.block_hash = block_hash
        cache.insert(block_hash, block)


def iter_free_blocks(queue: FreeKVCacheBlockQueue) -> Iterator[KVCacheBlock]:
    """The free queue from its head (next to be evicted) on."""
    iterate = getattr(queue, "iter_blocks_after", None)
    if iterate is not None:
        yield from iterate(None)
        return
    block, tail = queue.fake_free_list_head.next_free_block, queue.fake_free_list_tail
    while block is not None and block is not tail:
        yield block
        block = block.next_free_block


def watch_allocations(pool: BlockPool, on_evict: Callable[[list[KVCacheBlock]], None]) -> None:
    """Call ``on_evict(blocks)`` each time ``pool`` allocates fresh blocks, with those
    of them its prefix cache still holds (``block_hash`` set), before they are evicted
    and handed out: the head of its free queue, which ``get_new_blocks`` takes (every
    release 0.23-0.33). Evictions for other reasons (``evict_blocks``: a failed load,
    ``reset_prefix_cache``) are not allocations and are not reported."""
    allocate = pool.get_new_blocks

    def get_new_blocks(num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > 0:
            head = islice(iter_free_blocks(pool.free_block_queue), num_blocks)
            cached = [b for b in head if b.block_hash is not None]
            if cached:
                on_evict(cached)
        return allocate(num_blocks)

    pool.get_new_blocks = get_new_blocks


def watch_caching(pool: BlockPool, on_cached: Callable[[Any], None]) -> None:
    """Call ``on_cached(block_hash)`` (with group id) each time ``pool``'s prefix cache
    takes a block: its map's ``insert`` (every release 0.23-0.33)."""
    cache = pool.cached_block_hash_to_block
    insert = cache.insert

    def watched(key: Any, block: KVCacheBlock) -> None:
        insert(key, block)
        on_cached(key)

    cache.insert = watched


# -------------------------------------------------------------------- events
def block_stored(**fields: Any) -> Any:
    """A ``BlockStored`` event; ``locality`` only where the field exists."""
    if "locality" not in _BLOCK_STORED_FIELDS:
        fields.pop("locality", None)
    return kv_events.BlockStored(**fields)


def label_pool(pool: BlockPool, medium: str) -> Callable[[], list[Any]]:
    """Label ``pool``'s blocks as living on ``medium``; returns the pool's
    ``take_events``, whose events carry that medium (a pool without
    ``BlockPool.medium`` labels them as device memory: they are relabelled)."""
    relabel = not hasattr(pool, "medium")
    pool.medium = medium
    if not relabel:
        return pool.take_events

    def take_events() -> list[Any]:
        import msgspec

        return [e if getattr(e, "medium", medium) in (medium, None)
                else msgspec.structs.replace(e, medium=medium) for e in pool.take_events()]
    return take_events


def hash_seed_is_random(hash_algo: str | None) -> bool:
    """Whether vLLM seeds block hashing with ``hash_algo`` at random in every process,
    ``PYTHONHASHSEED`` unset: vLLM's own seed resolution (``resolve_none_hash_seed``)
    asked twice gives two seeds; a release without it always draws one."""
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
    except ImportError:
        return True
    resolve = getattr(kv_cache_utils, "resolve_none_hash_seed", None)
    if resolve is None:
        return True
    hash_fn = get_hash_fn_by_name(hash_algo or "sha256")
    return resolve(hash_fn) != resolve(hash_fn)


def get_kv_cache_configs(vllm_config: VllmConfig, kv_cache_specs: list[dict[str, Any]],
                         available_memory: list[int]) -> list[KVCacheConfig]:
    """vLLM's KV cache planner (``kv_cache_utils`` up to 0.32, ``kv_cache_planning``
    after, where the caller also passes the model's groups, planned first)."""
    try:
        from vllm.v1.core import kv_cache_planning as planning
    except ImportError:
        from vllm.v1.core import kv_cache_utils as planning
    groups = getattr(planning, "get_global_kv_cache_groups", None)
    if groups is None:
        return planning.get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory)
    return planning.get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory,
                                         groups(vllm_config, kv_cache_specs))
