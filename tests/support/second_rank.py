"""Rank 1 of an engine harness built with ``ranks=2`` (its one worker plays rank 0).

Every job rank 0 reports, rank 1 reports too, in the same step, as a worker
that copied the same blocks would; only the rounds of staged hits come one step
late, so that a test sees what the scheduler does between the two reports. At
start-up it hands over rank 1's handshake: a fresh tier, which kept nothing.
"""

from __future__ import annotations

import dataclasses

from kvoffload_hal.metadata import JobReport, OffloadHandshake, OffloadWorkerMetadata


class SecondRank:
    def __init__(self, engine) -> None:
        self._late: dict[int, JobReport] = {}
        # Rounds rank 0 reported in the last step and rank 1 did not yet.
        self.rounds_waiting: set[int] = set()
        self._build = engine.worker.build_connector_worker_meta
        engine.worker.build_connector_worker_meta = self._both_ranks
        every_tier = list(range(len(engine.offload.tiers.tiers)))  # a fresh tier: all done
        engine.connector.set_xfer_handshake_metadata_pp_aware(
            {(0, 1): OffloadHandshake(tier_scans_done=every_tier)})

    def _both_ranks(self) -> OffloadWorkerMetadata | None:
        mine = self._build() or OffloadWorkerMetadata()
        other = dataclasses.replace(mine, rounds=self._late)
        self._late = dict(mine.rounds)
        self.rounds_waiting = set(self._late)
        both = mine.aggregate(other)
        return both if both else None

    def run_checking_round_pins(self, engine, req_id: str, max_steps: int) -> int:
        """Step ``engine`` until ``req_id`` finishes; after each step, every round rank 0
        reported and rank 1 not yet must still hold its CPU blocks. Returns how many
        such rounds were checked."""
        cpu_blocks = engine.offload.cpu.pool.blocks
        checked = 0
        for _ in range(max_steps):
            if req_id in engine.finished:
                break
            engine.step()
            sent = {r.job_id: r for meta in engine.sent if meta is not None for r in meta.rounds}
            for job in self.rounds_waiting:
                assert all(cpu_blocks[b].ref_cnt for b in sent[job].cpu_blocks), job
                checked += 1
        return checked
