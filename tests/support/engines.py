"""Helpers around an in-process vLLM engine (see :mod:`kvoffload_hal.demo.inprocess`)."""

from __future__ import annotations

import time

from kvoffload_hal.demo.inprocess import scheduler_connector


def worker_connector():
    """The worker-role connector of the in-process engine, or None."""
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def drain_transfers(llm, timeout_s: float = 30.0) -> bool:
    """Step an idle engine until the connector has no copy in flight; False on timeout.

    A finished request's last stores (and disk spills) are planned when it
    finishes and complete in later engine steps; an idle server keeps stepping,
    an offline ``LLM.generate`` call does not. vLLM < 0.32 runs no worker in an
    idle step, so what is left there is confirmed by the engine's next request,
    as it would be in a server: a one-token request shorter than a block.
    """
    from kvoffload_hal import vllm_compat

    conn = scheduler_connector(llm)
    if conn is None:
        return True
    deadline = time.monotonic() + timeout_s
    idle_steps = 0
    while conn.scheduler.has_pending_transfers():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)  # as an idle engine waits for work: the copy threads run
        llm.llm_engine.step()
        idle_steps += 1
        if idle_steps % 100 == 0:
            vllm_compat.nudge_idle_engine(lambda: _next_request(llm))
    return True


def _next_request(llm) -> None:
    from vllm import SamplingParams

    llm.generate(["next"], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)


def serve_twice(spec, docs: list[str], max_tokens: int = 8) -> tuple[list, dict]:
    """An engine of ``spec`` serves each document, one at a time, then each again.

    Returns each request's ``(cached prompt tokens, generated tokens)`` and, with
    the connector, its counters plus ``cpu_blocks`` (the CPU tier's blocks) and,
    where the worker runs in this process, ``worker`` (its counters: bytes copied).
    """
    from vllm import SamplingParams

    from kvoffload_hal.demo.inprocess import close_llm, make_llm

    llm = make_llm(spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    try:
        outs = [llm.generate([d], params, use_tqdm=False)[0] for d in docs + docs]
        conn = scheduler_connector(llm)
        totals = {}
        if conn is not None:
            assert drain_transfers(llm)
            totals = dict(conn.scheduler.totals.data, cpu_blocks=conn.scheduler.cpu.num_blocks)
            worker = worker_connector()
            if worker is not None:
                totals["worker"] = dict(worker.worker.totals.data)
        return [(o.num_cached_tokens, list(o.outputs[0].token_ids)) for o in outs], totals
    finally:
        close_llm(llm)
