"""The scheduler half of every secondary tier: what a tier author never writes.

The index of what a tier holds (:mod:`.index`), spills and jobs (:mod:`.spill`), every
read of its blocks (:mod:`.reads`), promotions (:mod:`.promotions`), the slot planner
(:mod:`.plan`), every tier's circuit breaker (:mod:`.breaker`), a shared tier's queries
(:mod:`.shared`), staged hits (:mod:`.staged`) and the lookahead (:mod:`.prefetch`).
``scheduler/core.py`` calls :mod:`.chain`: the tiers, nearest first.
"""
