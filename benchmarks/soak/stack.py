"""What the soak runs against: the served connector, a reference server without it,
the disk tier's small tmpfs and, when the tier config names one, a Mooncake master."""

from __future__ import annotations

import json
import os
import subprocess
from contextlib import ExitStack, contextmanager
from pathlib import Path

from soak.config import MAX_MODEL_LEN, SoakConfig, tier_config, uses_mooncake
from support.openai_server import Server

BENCHMARKS = str(Path(__file__).resolve().parents[1])


def transfer_config(extra: dict) -> str:
    return json.dumps({"kv_connector": "SoakProbeConnector",
                       "kv_connector_module_path": "soak.probe_connector",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": extra})


def server_flags(cfg: SoakConfig) -> list[str]:
    return ["--max-num-seqs", str(max(8, cfg.clients * 2)), "--max-model-len",
            str(MAX_MODEL_LEN), "--shutdown-timeout", "10"]


def start_servers(cfg: SoakConfig, model: str, mooncake: str | None) -> tuple[Server, Server]:
    """The served connector (probed) and the reference engine, started together."""
    logs = cfg.work_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {"SOAK_PROBE_FILE": str(cfg.work_dir / "probe.json"),
           "PYTHONPATH": os.pathsep.join(filter(None, [BENCHMARKS,
                                                       os.environ.get("PYTHONPATH")]))}
    served = Server(model, logs / "served.log", num_gpu_blocks=cfg.device_blocks,
                    offload=False, env=env,
                    extra_args=[*server_flags(cfg), "--kv-transfer-config",
                                transfer_config(tier_config(cfg, mooncake))])
    reference = Server(model, logs / "reference.log", num_gpu_blocks=cfg.device_blocks,
                       offload=False, extra_args=server_flags(cfg))
    return served, reference


@contextmanager
def tmpfs(cfg: SoakConfig):
    """A ``tmpfs_mib`` tmpfs at the mount point (root only): True when mounted. Else a
    plain directory, and no ENOSPC fault (False)."""
    point = cfg.mount_point
    point.mkdir(parents=True, exist_ok=True)
    mounted = False
    if os.geteuid() == 0:
        rc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={cfg.tmpfs_mib}m,mode=0700",
                             "soak-tmpfs", str(point)], capture_output=True)
        mounted = rc.returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(point)], check=False)


# The master evicts once its segments are this full. Its default (0.9) is above what a
# segment of blocks reaches (each object is a block and its header): puts failed for
# want of space before any eviction, and those failures, not the faults, opened the
# tier's circuit breaker.
MASTER_FLAGS = ("-eviction_high_watermark_ratio=0.75", "-eviction_ratio=0.1")


@contextmanager
def mooncake_master(cfg: SoakConfig):
    """A local master when the tier config uses Mooncake, else None."""
    if not uses_mooncake(cfg):
        yield None
        return
    from support.mooncake_master import MooncakeMaster

    with MooncakeMaster(str(cfg.work_dir / "logs" / "mooncake_master.log"),
                        flags=MASTER_FLAGS) as master:
        yield master


@contextmanager
def stack(cfg: SoakConfig, model: str):
    """(served, reference, master, mounted) for the length of the block."""
    with ExitStack() as stack_:
        mounted = stack_.enter_context(tmpfs(cfg))
        (cfg.work_dir / "logs").mkdir(parents=True, exist_ok=True)
        master = stack_.enter_context(mooncake_master(cfg))
        served, reference = start_servers(cfg, model, master and master.address)
        stack_.callback(reference.kill)
        stack_.callback(served.kill)
        served.wait_ready()
        reference.wait_ready()
        yield served, reference, master, mounted
