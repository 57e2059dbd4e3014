"""vLLM plugin entry point (group ``vllm.general_plugins``).

vLLM calls :func:`register` in every process it starts (engine core, workers,
the API server), possibly more than once per process, so it must be idempotent.
"""

from __future__ import annotations

CONNECTOR_NAME = "HALOffloadConnector"


def register() -> None:
    """Make ``kv_connector="HALOffloadConnector"`` resolve to our connector.

    Also records the memory available as the process starts, before it loads a
    model or allocates a KV cache (:mod:`kvoffload_hal.host_memory`).
    """
    from kvoffload_hal.host_memory import note_start

    note_start()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(
        CONNECTOR_NAME, "kvoffload_hal.connector", "HALOffloadConnector"
    )
