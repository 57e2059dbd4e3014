"""The soak run's settings, and the one place its tier chain is configured.

:func:`tier_config` is all that changes when the chain CPU -> disk -> Mooncake
lands: today one secondary tier runs at a time (``disk_path`` and
``mooncake_master`` together are refused), so a run picks ``tiers="disk"`` (the
default) or ``tiers="mooncake"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

BLOCK_SIZE = 32
# K and V x 2 layers x 2 KV heads x head size 64 x 32 tokens x fp32 (the tiny Llama).
BLOCK_BYTES = 2 * 2 * 2 * 64 * BLOCK_SIZE * 4
MAX_MODEL_LEN = 512


@dataclass
class SoakConfig:
    minutes: float = 10.0
    clients: int = 6
    seed: int = 0
    work_dir: Path = Path("/tmp/kvoffload-soak")
    tiers: str = "disk"  # "disk" or "mooncake" (one secondary tier at a time, see above)
    device_blocks: int = 64  # ~5 long-document requests
    cpu_blocks: int = 128
    disk_blocks: int = 640
    tmpfs_mib: int = 64  # the disk tier's filesystem; a filler file makes it ENOSPC
    warmup_s: float = 30.0
    fault_every_s: tuple[float, float] = (15.0, 40.0)
    fault_hold_s: float = 8.0
    request_deadline_s: float = 120.0
    sample_every_s: float = 2.0
    reference_share: float = 0.2  # of completed requests, replayed on the reference
    max_reference: int = 150
    faults: tuple[str, ...] = ("enospc", "damage", "remove", "burst", "mooncake_freeze",
                               "mooncake_kill")
    out_dir: Path | None = None  # table, samples and plot
    fault_rounds: int = 0  # each fault once per round; 0: as many as the time allows
    leak_bounds: dict = field(default_factory=dict)  # overrides checks.SLOPE_BOUNDS
    min_leak_requests: int = 1000  # slopes over fewer requests are shown, not judged
    rss_slack_bytes: int = 256 << 20  # idle RSS at the end vs just after warm-up

    @property
    def disk_path(self) -> Path:
        return self.work_dir / "mnt" / "tier"

    @property
    def mount_point(self) -> Path:
        return self.work_dir / "mnt"


def tier_config(cfg: SoakConfig, mooncake_address: str | None) -> dict:
    """``kv_connector_extra_config`` of the served connector: the CPU tier and the
    secondary tier(s). The chain, once it lands, is one more entry here."""
    extra: dict = {"cpu_bytes_to_use": cfg.cpu_blocks * BLOCK_BYTES}
    if cfg.tiers == "disk":
        extra.update(disk_path=str(cfg.disk_path),
                     disk_bytes_to_use=cfg.disk_blocks * BLOCK_BYTES,
                     disk_retention="remove")
    elif cfg.tiers == "mooncake":
        assert mooncake_address is not None
        extra.update(mooncake_master=mooncake_address, mooncake_timeout_s=2.0,
                     mooncake_connect_timeout_s=2.0, mooncake_segment_bytes=64 << 20,
                     mooncake_buffer_bytes=32 << 20)
    else:
        raise ValueError(f"tiers={cfg.tiers!r}: expected 'disk' or 'mooncake'")
    return extra


def uses_disk(cfg: SoakConfig) -> bool:
    return "disk_path" in tier_config(cfg, "127.0.0.1:1")


def uses_mooncake(cfg: SoakConfig) -> bool:
    return "mooncake_master" in tier_config(cfg, "127.0.0.1:1")
