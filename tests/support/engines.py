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
    an offline ``LLM.generate`` call does not.
    """
    conn = scheduler_connector(llm)
    if conn is None:
        return True
    deadline = time.monotonic() + timeout_s
    while conn.scheduler.has_pending_transfers():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)  # as an idle engine waits for work: the copy threads run
        llm.llm_engine.step()
    return True
