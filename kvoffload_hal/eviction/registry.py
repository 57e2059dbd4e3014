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

# The measurements behind both defaults: docs/benchmarks.md, "The defaults".
DEFAULT_EVICTION = "adaptive"

# What the CPU tier does with its copies of blocks the device also holds
# (kvoffload_hal.scheduler.device_copies); "keep": the tiers are inclusive.
DEVICE_COPY_MODES = ("keep", "drop")
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
