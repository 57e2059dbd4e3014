"""Eviction policies by name: the built-ins, and third-party policies by entry point.

Runs wherever the configuration is read (every process); a policy's module is
imported only when the CPU tier builds it, in the scheduler process.

A policy is an :class:`~kvoffload_hal.eviction.base.Eviction` subclass. The
built-ins are ``lru`` and ``adaptive``; another package adds one through the
entry-point group ``kvoffload_hal.eviction`` (``name = "pkg.module:PolicyClass"``)
or at run time with :func:`register_eviction`. Listing names imports nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload_hal.plugins import PluginTargets, load_class

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

    from kvoffload_hal.eviction.base import Eviction

ENTRY_POINT_GROUP = "kvoffload_hal.eviction"

# On the long-document benchmark at 32 documents of 256 tokens (tier of 30) "adaptive"
# computed 2720 tokens where LRU computed 4416 (minimum 2624), and it is within
# 0.001 of LRU or above it on the trace replays (docs/design.md#eviction).
DEFAULT_EVICTION = "adaptive"

# What the CPU tier does with its copies of blocks the device also holds
# (kvoffload_hal.eviction.device_copies). "keep" (inclusive tiers) by default: on the
# long-document benchmark "drop" computed fewer prompt tokens at 32 documents of 256
# tokens (3584 against 4416, minimum 2624) but more at 64 (24448 against 23104) and
# at 32 of 1024 tokens (9568 against 6688): where the requests running take the
# whole device cache, every dropped copy must be stored again when they end, and
# evicts a block only the CPU tier held (docs/design.md#one-cache).
DEVICE_COPY_MODES = ("keep", "drop", "drop_stored")
DEFAULT_DEVICE_COPIES = "keep"

_POLICIES = PluginTargets("eviction policy", ENTRY_POINT_GROUP, {
    "lru": "kvoffload_hal.eviction.base:LruEviction",
    "adaptive": "kvoffload_hal.eviction.adaptive:AdaptiveEviction",
}, class_word="PolicyClass")
# register_eviction(name, "module:PolicyClass") adds an Eviction subclass at run time.
register_eviction, unregister_eviction = _POLICIES.register, _POLICIES.unregister
eviction_targets = _POLICIES.targets


class EvictionSelectionError(RuntimeError):
    """A named eviction policy cannot be loaded. The message is one line."""


def eviction_names() -> tuple[str, ...]:
    """The names ``eviction`` accepts, built-ins first."""
    return tuple(eviction_targets())


def make_eviction(name: str, pool: BlockPool, num_blocks: int) -> Eviction:
    """The policy ``name`` over ``pool``; ``ValueError`` naming the key for an unknown name."""
    from kvoffload_hal.eviction.base import Eviction

    targets = eviction_targets()
    if name not in targets:
        raise ValueError(f"kv_connector_extra_config['eviction']={name!r}: expected one of "
                         f"{', '.join(targets)}")
    cls = load_class("eviction policy", name, targets[name], Eviction, EvictionSelectionError)
    return cls(pool, num_blocks)
