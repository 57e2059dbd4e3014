"""Secondary tiers by name: the built-ins, and third-party tiers by entry point.

A tier is a :class:`~kvoffload_hal.tiers.spec.TierSpec` subclass. The
built-ins are ``disk`` and ``mooncake``; another package adds one through the
entry-point group ``kvoffload_hal.tiers`` (``name = "pkg.module:SpecClass"``) or
at run time with :func:`register_tier`. Spec modules are imported when the
configuration is read, so they import neither vLLM's engine nor a device
runtime at module level (the halves do, when built).

Several tiers run behind the CPU tier as a chain, nearest first
(:func:`parse_tiers`; the ``tiers`` key names their order).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kvoffload_hal.logger import init_logger
from kvoffload_hal.plugins import PluginTargets, load_class
from kvoffload_hal.tiers.spec import TierSpec

if TYPE_CHECKING:
    from kvoffload_hal.tiers.spec import (
        SchedulerHalf,
        SchedulerTierContext,
        SecondaryTier,
        WorkerTierContext,
    )

logger = init_logger(__name__)

ENTRY_POINT_GROUP = "kvoffload_hal.tiers"


class TierSelectionError(RuntimeError):
    """A registered tier cannot be loaded. The message is one line."""


_TIERS = PluginTargets("tier", ENTRY_POINT_GROUP, {
    "disk": "kvoffload_hal.tiers.disk:DiskTierSpec",
    "mooncake": "kvoffload_hal.tiers.mooncake:MooncakeTierSpec",
}, class_word="SpecClass")
# register_tier(name, "module:SpecClass") adds a TierSpec subclass at run time.
register_tier, unregister_tier, tier_targets = _TIERS.register, _TIERS.unregister, _TIERS.targets


def spec_class(name: str, target: str) -> type[TierSpec]:
    return load_class("tier", name, target, TierSpec, TierSelectionError)


def spec_classes() -> list[type[TierSpec]]:
    return [spec_class(name, target) for name, target in tier_targets().items()]


def tier_labels() -> dict[str, str]:
    """``name -> label`` of every tier that loads (for its counters' help texts)."""
    labels = {}
    for name, target in tier_targets().items():
        try:
            labels[name] = spec_class(name, target).display_name()
        except TierSelectionError as e:
            logger.warning("%s; its metrics are not registered", e)
    return labels


def tier_keys() -> tuple[str, ...]:
    """Every key of the tiers in ``kv_connector_extra_config``: their order, and each
    tier's own."""
    return (TIERS_KEY, *(key for cls in spec_classes() for key in cls.keys))


# The key that orders the tiers turned on, nearest first.
TIERS_KEY = "tiers"


def parse_tiers(extra: dict[str, Any]) -> tuple[TierSpec, ...]:
    """The secondary tiers ``extra`` turns on, validated, nearest first (empty: none).

    Each tier is turned on by its own keys. With several, ``tiers`` names their order;
    without it, tiers that only this instance writes come before tiers shared across
    instances (a local disk before a cluster pool), in the registry's order."""
    specs = [spec for cls in spec_classes() if (spec := cls.from_extra_config(extra))]
    order = extra.get(TIERS_KEY)
    if order is None:
        return tuple(sorted(specs, key=lambda spec: spec.shared_across_instances))
    by_name = {spec.name: spec for spec in specs}
    expected = (f"a list of tier names, nearest first, each turned on by its own keys "
                f"(known tiers: {', '.join(tier_targets())})")
    if not isinstance(order, (list, tuple)) or not all(isinstance(n, str) for n in order):
        raise ValueError(f"kv_connector_extra_config['{TIERS_KEY}'] = {order!r}: expected "
                         f"{expected}")
    for name in order:
        if name not in by_name or list(order).count(name) > 1:
            why = ("is named twice" if name in by_name else
                   f"is not turned on (set '{_switch_key(name)}')" if name in tier_targets()
                   else "is no known tier")
            raise ValueError(f"kv_connector_extra_config['{TIERS_KEY}'] = {order!r}: "
                             f"'{name}' {why}; expected {expected}")
    left_out = [spec for spec in specs if spec.name not in order]
    if left_out:
        raise ValueError(
            f"kv_connector_extra_config['{TIERS_KEY}'] = {order!r} leaves out the "
            f"{left_out[0].name} tier, which '{left_out[0].switch_key}' turns on: name it "
            f"in '{TIERS_KEY}', or remove its keys")
    return tuple(by_name[name] for name in order)


def _switch_key(name: str) -> str:
    return spec_class(name, tier_targets()[name]).switch_key


def why_tier_is_off(spec: TierSpec, kv_cache_config: Any) -> str | None:
    """Why the configured tier cannot serve this model, or None when it can."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) == 1:
        return None
    if spec.one_group_only:
        return f"the {spec.name} tier supports models with one KV cache group"
    sizes = sorted({g.kv_cache_spec.block_size for g in groups})
    if len(sizes) > 1:
        return (f"the {spec.name} tier keeps blocks of one size, and this model's KV cache "
                f"groups have blocks of {', '.join(map(str, sizes))} tokens")
    return None


def tier_runs(spec: TierSpec | None, kv_cache_config: Any) -> bool:
    """The configured tier runs for this model."""
    return spec is not None and why_tier_is_off(spec, kv_cache_config) is None


def scheduler_half(spec: TierSpec | None, runs: bool,
                   ctx: SchedulerTierContext) -> SchedulerHalf | None:
    """What the scheduler keeps for ``spec``; None without a tier that runs (with one
    warning when the model keeps a configured tier off)."""
    if spec is None:
        return None
    if not runs:
        logger.warning("HALOffloadConnector: %s; it is disabled for this model",
                       why_tier_is_off(spec, ctx.kv_cache_config))
        return None
    return spec.scheduler_half(ctx)


def build_worker_half(spec: TierSpec | None, runs: bool,
                      ctx: WorkerTierContext) -> SecondaryTier:
    from kvoffload_hal.tiers.spec import NullTier

    if spec is None or not runs:
        return NullTier()
    if spec.shared_across_instances and os.environ.get("PYTHONHASHSEED") is None:
        logger.warning("the %s tier: PYTHONHASHSEED is not set, so vLLM's block hashes "
                       "differ per process: other instances will not find this one's "
                       "blocks (set the same PYTHONHASHSEED on every instance)", spec.name)
    return spec.worker_half(ctx)
