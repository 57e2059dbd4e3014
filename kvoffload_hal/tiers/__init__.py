"""Secondary tiers behind the CPU tier: what a tier author touches.

The contract, both halves (:mod:`.spec`), the registry (:mod:`.registry`), the worker halves'
base class (:mod:`.worker_pool`), the identity of a block's
bytes (:mod:`.identity`, :mod:`.weights_digest`, :mod:`.block_value`) and one folder
per tier (``disk/``, ``mooncake/``). Imported in every process; nothing here imports
the scheduler or the worker, whose halves of a tier live in
:mod:`kvoffload_hal.scheduler.secondary` and :mod:`kvoffload_hal.worker`.
"""
