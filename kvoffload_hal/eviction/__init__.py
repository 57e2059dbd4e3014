"""Eviction policies of the CPU tier: the contract, the built-ins, the registry.

A plug-in family like :mod:`kvoffload_hal.hal` (copy backends) and
:mod:`kvoffload_hal.tiers` (secondary tiers). Policies run in the scheduler
process, inside :class:`~kvoffload_hal.scheduler.cpu_tier.CpuTier`; the package
sits below ``scheduler/`` so that ``config.py`` can check a policy's name
through :mod:`.registry` without importing the scheduler.
"""
