"""Eviction policies the benchmarks compare with, registered at import.

``adaptive-no-ends``: ``adaptive`` blind to blocks that end a prompt exactly
(:meth:`kvoffload_hal.eviction.base.Eviction.on_prompt_ends`): such a block is
ranked like any other, as ``adaptive`` ranked it before it had a rule for them.
"""

from __future__ import annotations

from kvoffload_hal.eviction.adaptive import AdaptiveEviction
from kvoffload_hal.eviction.base import Eviction
from kvoffload_hal.eviction.registry import eviction_names, register_eviction

NO_ENDS = "adaptive-no-ends"


class AdaptiveWithoutPromptEnds(AdaptiveEviction):
    name = NO_ENDS
    on_prompt_ends = Eviction.on_prompt_ends


if NO_ENDS not in eviction_names():
    register_eviction(NO_ENDS, f"{__name__}:AdaptiveWithoutPromptEnds")
