"""The Mooncake tier's keys in ``kv_connector_extra_config``, validated once.

==============================  ===============  ============================================
key                             default          meaning
==============================  ===============  ============================================
``mooncake_master``             (none)           ``host:port`` of ``mooncake_master``: turns
                                                 the Mooncake tier on
``mooncake_protocol``           ``tcp``          Mooncake's transport: ``tcp``, ``rdma``, or
                                                 ``ascend`` (its NPU build)
``mooncake_local_hostname``     ``127.0.0.1``    the address other instances reach this one
                                                 at (required when the master is not on
                                                 loopback)
``mooncake_metadata_server``    ``P2PHANDSHAKE`` Mooncake's metadata service
``mooncake_rdma_devices``       ``""``           RDMA devices for ``rdma`` (empty: all)
``mooncake_segment_bytes``      1 GiB            host memory each rank adds to the cluster's
                                                 pool (int bytes, at least 16 MiB)
``mooncake_buffer_bytes``       64 MiB           the client's own transfer buffer (int > 0)
``mooncake_timeout_s``          5.0              longest a request waits for an existence
                                                 query or a read (it then recomputes)
``mooncake_connect_timeout_s``  5.0              longest start-up waits for the master
``mooncake_required``           ``false``        ``true``: refuse to start when the master
                                                 is unreachable; ``false``: start without the
                                                 tier, with one warning
==============================  ===============  ============================================

One secondary tier runs at a time: setting both ``disk_path`` and
``mooncake_master`` is refused (:mod:`kvoffload_hal.tiers.registry`).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from kvoffload_hal.config_values import (
    boolean,
    one_of,
    positive_int,
    positive_seconds,
    text,
    where,
)

MOONCAKE_KEYS = ("mooncake_master", "mooncake_protocol", "mooncake_local_hostname",
                 "mooncake_metadata_server", "mooncake_rdma_devices", "mooncake_segment_bytes",
                 "mooncake_buffer_bytes", "mooncake_timeout_s", "mooncake_connect_timeout_s",
                 "mooncake_required")
# Transports the Mooncake transfer engine names: tcp everywhere, rdma on
# InfiniBand/RoCE, ascend in its NPU build (mooncake-transfer-engine-npu).
PROTOCOLS = ("tcp", "rdma", "ascend")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# The client refuses a smaller segment: setup returns -600 and its log says "Total
# size must be at least 16777216" (client_buffer_allocation.cpp, client 0.3.13).
MIN_SEGMENT_BYTES = 16 << 20


def parse_address(key: str, value: Any) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as a pair; ``ValueError`` naming the key otherwise."""
    host, sep, port = text(key, value).rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{where(key, value)}: expected host:port")
    return host, int(port)


@dataclass(frozen=True)
class MooncakeConfig:
    master: str
    protocol: str = "tcp"
    local_hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    rdma_devices: str = ""
    segment_bytes: int = 1 << 30
    buffer_bytes: int = 64 << 20
    timeout_s: float = 5.0
    connect_timeout_s: float = 5.0
    required: bool = False

    @property
    def master_host_port(self) -> tuple[str, int]:
        return parse_address("mooncake_master", self.master)


def segment_size(value: Any) -> int:
    """``mooncake_segment_bytes``, refused here rather than by the client's setup."""
    value = positive_int("mooncake_segment_bytes", value)
    if value < MIN_SEGMENT_BYTES:
        raise ValueError(f"{where('mooncake_segment_bytes', value)}: the Mooncake client "
                         f"needs a segment of at least {MIN_SEGMENT_BYTES} bytes (16 MiB)")
    return value


def parse_mooncake(extra: dict[str, Any]) -> MooncakeConfig | None:
    """The Mooncake tier's configuration, or None when ``mooncake_master`` is unset."""
    master = extra.get("mooncake_master")
    if master is None:
        stray = [k for k in MOONCAKE_KEYS if k in extra]
        if stray:
            raise ValueError(f"kv_connector_extra_config['{stray[0]}'] is set but "
                             "'mooncake_master' is not: expected both for a Mooncake tier")
        return None
    host, _ = parse_address("mooncake_master", master)
    protocol = one_of("mooncake_protocol", extra.get("mooncake_protocol", "tcp"), PROTOCOLS)
    if "mooncake_local_hostname" in extra:
        local = text("mooncake_local_hostname", extra["mooncake_local_hostname"])
    elif host in LOOPBACK:
        local = "127.0.0.1"
    else:
        raise ValueError(f"{where('mooncake_master', master)} is not on loopback: expected "
                         "'mooncake_local_hostname', the address other instances reach this "
                         f"one at (this host is {socket.gethostname()!r})")
    required = boolean("mooncake_required", extra.get("mooncake_required", False))
    return MooncakeConfig(
        master=master, protocol=protocol, local_hostname=local,
        metadata_server=text("mooncake_metadata_server",
                             extra.get("mooncake_metadata_server", "P2PHANDSHAKE")),
        rdma_devices=text("mooncake_rdma_devices", extra.get("mooncake_rdma_devices", ""),
                          allow_empty=True),
        segment_bytes=segment_size(extra.get("mooncake_segment_bytes", 1 << 30)),
        buffer_bytes=positive_int("mooncake_buffer_bytes",
                                  extra.get("mooncake_buffer_bytes", 64 << 20)),
        timeout_s=positive_seconds("mooncake_timeout_s", extra.get("mooncake_timeout_s", 5.0)),
        connect_timeout_s=positive_seconds("mooncake_connect_timeout_s",
                                           extra.get("mooncake_connect_timeout_s", 5.0)),
        required=required,
    )
