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
        if idle_steps % 100 == 0 and not vllm_compat.STEPS_FOR_PUSH_WORK:
            _next_request(llm)
    return True


def _next_request(llm) -> None:
    from vllm import SamplingParams

    llm.generate(["next"], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
