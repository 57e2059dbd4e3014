"""Reaching the Mooncake master: a bounded probe, and a client set up off the engine thread.

``mooncake`` is imported here, lazily: importing :mod:`kvoffload_hal` never
needs it. Two facts of the 0.3.13 client shape this module:

* ``setup`` with an unreachable master retries for about 90 s before it
  fails, so both roles first try a plain TCP connection to the master,
  bounded by ``mooncake_connect_timeout_s``, and only then set a client up
  (on a thread, so a master that accepts and never answers is bounded too);
* the client links ``libibverbs``, ``librdmacm`` and ``libnuma`` even for
  TCP: a missing one is an ``ImportError`` naming it.

An unreachable master gives one line: a warning and no Mooncake tier, or,
with ``mooncake_required``, a refused start-up.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

from kvoffload_hal.logger import init_logger, log_once
from kvoffload_hal.tiers.mooncake.config import MooncakeConfig

logger = init_logger(__name__)

INSTALL_HINT = ("pip install 'kvoffload-hal[mooncake]' (mooncake-transfer-engine; "
                "-non-cuda on CPU hosts, -npu on Ascend) and the Debian packages "
                "libibverbs1 librdmacm1 libnuma1")


class MooncakeUnavailable(RuntimeError):
    """The Mooncake tier cannot run: the reason is the message."""


def master_problem(cfg: MooncakeConfig) -> str | None:
    """Why the master cannot be reached now (None when a TCP connection opens)."""
    host, port = cfg.master_host_port
    try:
        with socket.create_connection((host, port), timeout=cfg.connect_timeout_s):
            return None
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"


def tier_available(cfg: MooncakeConfig, role: str) -> bool:
    """True when the master answers. Otherwise one warning and False, or with
    ``mooncake_required`` a :class:`MooncakeUnavailable` naming the master."""
    problem = master_problem(cfg)
    if problem is None:
        return True
    refuse_or_warn(cfg, role, f"master {cfg.master} unreachable ({problem})")
    return False


def refuse_or_warn(cfg: MooncakeConfig, role: str, why: str) -> None:
    if cfg.required:
        raise MooncakeUnavailable(f"Mooncake tier ({role}): {why}; refusing to start because "
                                  "kv_connector_extra_config['mooncake_required'] is true")
    # Once per process: the scheduler and a worker sharing one process say it once.
    log_once(logger, logging.WARNING, "Mooncake tier: %s; serving without it (recomputing "
             "what it would have held)", why)


def import_store_class() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise MooncakeUnavailable(f"cannot import mooncake.store ({e}); install it with "
                                  f"{INSTALL_HINT}") from None
    return MooncakeDistributedStore


def connect(cfg: MooncakeConfig) -> Any:
    """A set-up ``MooncakeDistributedStore`` client; :class:`MooncakeUnavailable` if not."""
    store_class = import_store_class()
    client = store_class()
    result: list[Any] = []

    def setup() -> None:
        try:
            result.append(client.setup(cfg.local_hostname, cfg.metadata_server,
                                       cfg.segment_bytes, cfg.buffer_bytes, cfg.protocol,
                                       cfg.rdma_devices, cfg.master))
        except Exception as e:  # noqa: BLE001 - reported as the reason below
            result.append(e)

    thread = threading.Thread(target=setup, name="kvoffload-mooncake-setup", daemon=True)
    thread.start()
    # A reachable master answers setup in tens of milliseconds; the client's
    # own retries (about 90 s) are what this bound cuts short.
    thread.join(cfg.connect_timeout_s * 4)
    if thread.is_alive():
        raise MooncakeUnavailable(f"setup with master {cfg.master} did not finish within "
                                  f"{cfg.connect_timeout_s * 4:.0f} s")
    outcome = result[0]
    if isinstance(outcome, Exception) or outcome != 0:
        raise MooncakeUnavailable(f"setup with master {cfg.master} over {cfg.protocol} failed "
                                  f"({outcome!r})")
    return client


def register(client: Any, ptr: int, num_bytes: int, what: str) -> None:
    """Register host memory for zero-copy puts and gets (once, at start-up)."""
    rc = client.register_buffer(ptr, num_bytes)
    if rc != 0:
        raise MooncakeUnavailable(f"registering the {what} ({num_bytes} bytes) failed "
                                  f"(code {rc})")
