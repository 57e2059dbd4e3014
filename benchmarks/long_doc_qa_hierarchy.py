"""Belady's optimum of an engine's whole cache hierarchy, for ``long_doc_qa.py``.

The CPU tier's own trace (``Eviction.trace``) sees only what reaches the tier: the
device's hits are hidden from it, and its stores include blocks the device still
holds. Here the trace is the requests themselves, in the order the engine admitted
them (warm-up pass included): each one reads the full blocks of its prompt that a
prefix hit can cover (vLLM always computes the last prompt token). Belady's
optimum (MIN with bypass) of a cache as large as the device cache and the CPU tier
together (and the disk tier, where one runs) bounds what any placement of blocks
between the tiers could serve in the measured pass. It is an upper bound: the
device also holds the blocks of the requests it runs. Beside it, the same cache
told how many more times each block is read but not when
(:func:`~kvoffload_hal.demo.eviction_replay.count_oracle_hits`): in a random order
of reads, what no online placement can be expected to beat.
"""

from __future__ import annotations

from typing import Any

from kvoffload_hal.demo.eviction_replay import belady_hits, count_oracle_hits


class Admissions:
    """Every request the engine schedules for the first time, with the blocks it can hit."""

    def __init__(self, scheduler: Any, block_size: int) -> None:
        """``scheduler``: vLLM's ``Scheduler`` (an in-process engine's, or a bare one)."""
        self.block_size = block_size
        self.requests: list[list[Any]] = []  # block hashes a prefix hit can cover
        self._seen: set[str] = set()
        schedule = scheduler.schedule

        def recording_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            for new in out.scheduled_new_reqs:
                if new.req_id not in self._seen:
                    self._seen.add(new.req_id)
                    request = scheduler.requests[new.req_id]
                    readable = (len(request.prompt_token_ids) - 1) // self.block_size
                    self.requests.append(list(request.block_hashes[:readable]))
            return out

        scheduler.schedule = recording_schedule

    def optimum(self, capacity_blocks: int, counted_from: int) -> dict[str, int]:
        """Belady's hit blocks over the requests from ``counted_from`` on (the
        measured pass), the cache warmed by those before; and the most there are."""
        ids: dict[Any, int] = {}
        trace = [[ids.setdefault(h, len(ids)) for h in r] for r in self.requests]
        return {"belady": belady_hits(trace, capacity_blocks, counted_from=counted_from),
                "counts": count_oracle_hits(trace, capacity_blocks, counted_from=counted_from),
                "possible": sum(len(r) for r in trace[counted_from:]),
                "capacity": capacity_blocks}


def hierarchy_table(results: list[Any], ns: list[int], block_size: int) -> str:
    """Per engine: prompt blocks served by any cache in the measured pass against
    Belady's optimum of all its caches together; the CPU tier's own figure beside."""
    lines = ["| docs | engine | caches (blocks) | hit blocks | Belady, all caches | "
             "fraction | tokens computed | at Belady's hits | at the hits of reads-left "
             "knowledge | CPU-tier hits (Belady on its trace) |",
             "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in ns:
        for r in (r for r in results if r.num_docs == n and "hierarchy" in r.extra):
            h = r.extra["hierarchy"]
            tier = r.extra.get("trace_hits")
            at_belady = r.scheduled_tokens - (h["belady"] - h["hits"]) * block_size
            at_counts = r.scheduled_tokens - (h["counts"] - h["hits"]) * block_size
            cpu_tier = f"{tier['tier']} ({tier['belady']})" if tier else "-"
            lines.append(
                f"| {n} | {r.config} | {h['capacity']} | {h['hits']} | {h['belady']} | "
                f"{h['hits'] / max(1, h['belady']):.3f} | {r.scheduled_tokens} | "
                f"{at_belady} | {at_counts} | {cpu_tier} |")
    return "\n".join(lines)
