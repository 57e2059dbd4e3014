"""The soak run's settings, and the one place its tier chain is configured.

:func:`tier_config` builds ``kv_connector_extra_config`` from ``SoakConfig.tiers``:
``"chain"`` (the default) runs the whole chain CPU -> disk -> Mooncake (``disk_path``
and ``mooncake_master`` together, ``tiers=["disk", "mooncake"]``), ``"disk"`` or
``"mooncake"`` runs that secondary tier alone behind the CPU tier.
:func:`tier_names` is the chain's order, nearest first, as the scheduler names the
tiers (its counters are ``blocks_to_<name>``, ``<name>_failed_blocks``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

BLOCK_SIZE = 32
# K and V x 2 layers x 2 KV heads x head size 64 x 32 tokens x fp32 (the tiny Llama).
BLOCK_BYTES = 2 * 2 * 2 * 64 * BLOCK_SIZE * 4
MAX_MODEL_LEN = 512
# SoakConfig.tiers: the secondary tiers behind the CPU tier, nearest first.
TIER_CHOICES: dict[str, tuple[str, ...]] = {"chain": ("disk", "mooncake"),
                                            "disk": ("disk",), "mooncake": ("mooncake",)}
MOONCAKE_SEGMENT_BYTES = 64 << 20


@dataclass
class SoakConfig:
    minutes: float = 10.0
    clients: int = 6
    seed: int = 0
    work_dir: Path = Path("/tmp/kvoffload-soak")
    tiers: str = "chain"  # a key of TIER_CHOICES
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
    # Idle RSS at the end vs just after warm-up may grow by this much; with
    # reference_load, by this much more than the reference engine's own growth over the
    # same requests (reference_load.py).
    rss_slack_bytes: int = 256 << 20
    reference_load: bool = False

    def __post_init__(self) -> None:
        if self.tiers not in TIER_CHOICES:
            raise ValueError(f"SoakConfig.tiers = {self.tiers!r}: expected one of "
                             f"{', '.join(map(repr, TIER_CHOICES))}")

    @property
    def disk_path(self) -> Path:
        return self.work_dir / "mnt" / "tier"

    @property
    def mount_point(self) -> Path:
        return self.work_dir / "mnt"


def tier_names(cfg: SoakConfig) -> tuple[str, ...]:
    """The secondary tiers of the run, nearest first."""
    return TIER_CHOICES[cfg.tiers]


def tier_config(cfg: SoakConfig, mooncake_address: str | None) -> dict:
    """``kv_connector_extra_config`` of the served connector: the CPU tier and the
    secondary tiers of ``cfg.tiers``, in their order."""
    names = tier_names(cfg)
    extra: dict = {"cpu_bytes_to_use": cfg.cpu_blocks * BLOCK_BYTES}
    if "disk" in names:
        extra.update(disk_path=str(cfg.disk_path),
                     disk_bytes_to_use=cfg.disk_blocks * BLOCK_BYTES,
                     disk_retention="remove")
    if "mooncake" in names:
        if mooncake_address is None:
            raise ValueError(f"tiers={cfg.tiers!r} runs the Mooncake tier: a master's "
                             "address is needed")
        extra.update(mooncake_master=mooncake_address, mooncake_timeout_s=2.0,
                     mooncake_connect_timeout_s=2.0,
                     mooncake_segment_bytes=MOONCAKE_SEGMENT_BYTES,
                     mooncake_buffer_bytes=32 << 20)
    if len(names) > 1:
        extra["tiers"] = list(names)
    return extra


def uses_disk(cfg: SoakConfig) -> bool:
    return "disk" in tier_names(cfg)


def uses_mooncake(cfg: SoakConfig) -> bool:
    return "mooncake" in tier_names(cfg)
