"""What only ``make demo`` and the benchmarks use: an in-process engine
(:mod:`.inprocess`), offline random-weight models (:mod:`.tiny_model`), block-trace
replays (:mod:`.eviction_replay`) and the demo itself (``python -m kvoffload_hal.demo``)."""
