"""Worker side, at the engine's exit: the tiers and the backend stopped, the host buffer freed.

Runs in each worker process, once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload_hal.logger import init_logger

if TYPE_CHECKING:
    from kvoffload_hal.hal import DmaCopyBackend
    from kvoffload_hal.hal.host import HostChunks
    from kvoffload_hal.worker.tiers import WorkerTiers

logger = init_logger(__name__)

# How long shutdown waits for copies and tier IO in flight (writes first get
# shutdown_flush_timeout_s, and are dropped when it is over).
SHUTDOWN_TIMEOUT_S = 10.0
# Host buffers a copy or tier IO may still use after shutdown gave up waiting:
# kept referenced until the process exits, never freed under a running copy.
_BUSY_AT_SHUTDOWN: list[HostChunks] = []


def shut_down(tiers: WorkerTiers, backend: DmaCopyBackend | None, host: HostChunks | None,
              flush_timeout_s: float) -> None:
    """Stop ``tiers`` and ``backend``, then free ``host``.

    Tier writes already submitted get ``flush_timeout_s`` to finish, and are dropped
    whole after it. A copy or a tier IO still running after :data:`SHUTDOWN_TIMEOUT_S`
    (a hung device or mount) would write into freed memory: the buffer is then kept
    until the process exits instead, with a warning.
    """
    tier_idle = tiers.shutdown(SHUTDOWN_TIMEOUT_S, flush_timeout_s)
    if backend is None:
        return
    backend_idle = backend.shutdown(SHUTDOWN_TIMEOUT_S)
    if host is None:
        return
    if tier_idle and backend_idle:
        backend.free_host_regions(host)
        return
    logger.warning("HALOffloadConnector: %s still running after %.0f s at shutdown; its "
                   "host memory (%.2f GiB) is kept until the process exits",
                   "a copy" if not backend_idle else "tier IO", SHUTDOWN_TIMEOUT_S,
                   host.num_bytes / 2**30)
    _BUSY_AT_SHUTDOWN.append(host)
