"""A connector that loads the wrong Mamba state: the control of the position test.

Every planned load of a hit takes, for each Mamba ('align' mode) group, another
state the CPU tier holds in place of the one at the hit's position; the
attention blocks are left as they are. A test that cannot tell the difference
could not tell a state from another position either.
"""

from __future__ import annotations

from kvoffload_hal.scheduler import load_jobs


def misplace_state_loads(monkeypatch) -> list[str]:
    """Patch the load planner; the ids of the requests given another state."""
    plan = load_jobs.LoadJobs.on_allocated
    swapped: list[str] = []

    def misplacing_plan(self, req_id, blocks, num_external_tokens):
        pending = self._pending_hits.get(req_id)
        if pending is not None and num_external_tokens > 0:
            hit = [list(group) for group in pending.blocks]
            for g in self.cpu.unstable_groups:
                if _swap_last_state(self.cpu, g, hit[g]):
                    swapped.append(req_id)
            self._pending_hits[req_id] = pending._replace(blocks=tuple(hit))
        return plan(self, req_id, blocks, num_external_tokens)

    monkeypatch.setattr(load_jobs.LoadJobs, "on_allocated", misplacing_plan)
    return swapped


def _swap_last_state(cpu, group_id: int, group_hit: list) -> bool:
    """Put another cached block of ``group_id`` at the hit's last position (pinned
    like the hit: the planner unpins what the pending hit holds)."""
    from vllm.v1.core.kv_cache_utils import get_group_id

    held = [i for i, block in enumerate(group_hit) if not block.is_null]
    if not held:
        return False
    mine = group_hit[held[-1]]
    others = [b for b in cpu.pool.blocks
              if not b.is_null and b.block_hash not in (None, mine.block_hash)
              and get_group_id(b.block_hash) == group_id]
    if not others:
        return False
    group_hit[held[-1]] = others[0]
    cpu.pin([others[0]])
    return True
