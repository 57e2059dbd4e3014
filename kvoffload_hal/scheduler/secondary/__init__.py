"""The scheduler half of every secondary tier: runs in the scheduler process.

What a tier author never writes: the index of what the tier holds (:mod:`.index`,
:mod:`.groups` for models with several KV cache groups, :mod:`.rebuild` after a
restart), spills and their jobs (:mod:`.spill`), every read of its blocks into the CPU
tier (:mod:`.reads`), promotions at a lookup (:mod:`.promotions`), a shared tier's
existence queries and circuit breaker (:mod:`.shared`, :mod:`.breaker`), hits longer
than the CPU tier's room (:mod:`.staged`) and the lookahead for waiting requests
(:mod:`.prefetch`). :mod:`.chain` is what ``scheduler/core.py`` calls: the tiers,
nearest first, built from the tiers' specs.
"""
