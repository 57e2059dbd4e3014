"""Soak: the served connector under concurrent streaming load and random faults.

Starts vLLM's OpenAI server on its CPU platform with the connector (the CPU tier
and the secondary tiers of ``soak/config.py``'s :func:`tier_config`: by default the
chain CPU -> disk -> Mooncake) and a reference server without it, drives mixed
streaming clients for ``--minutes`` while faults are injected (a full tmpfs under
``disk_path``, block files damaged or removed, a burst larger than the device and
the CPU tier, the Mooncake master frozen or killed when the Mooncake tier runs),
then prints a table: tokens against the reference, errors and hangs, leak slopes
per 1000 requests, counter balance per tier, faults seen, the scheduler hooks'
p50/p99 per step. Writes table.md, samples.jsonl, soak.png
and lscpu.txt to ``--out``. Mounting the tmpfs needs root (else no ENOSPC fault).

    python benchmarks/soak.py --minutes 30 [--clients 6] [--tiers chain|disk|mooncake]
                              [--faults enospc,burst,...] [--out docs/benchmarks/soak]
                              [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak.config import TIER_CHOICES, SoakConfig  # noqa: E402
from soak.driver import run  # noqa: E402
from soak.report import write  # noqa: E402

from kvoffload_hal.demo.tiny_model import build_tiny_llama  # noqa: E402

FAULTS = SoakConfig().faults


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiers", choices=tuple(TIER_CHOICES), default="chain",
                        help="secondary tiers: chain (disk, then Mooncake), or one alone")
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"comma-separated, of {','.join(FAULTS)} (default: all)")
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--fault-every", type=float, nargs=2, default=(15.0, 40.0),
                        metavar=("MIN_S", "MAX_S"), help="seconds between faults")
    parser.add_argument("--work-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "kvoffload-soak")
    parser.add_argument("--reference-load", action="store_true",
                        help="after the run, drive the reference engine with the same clients "
                             "and judge RSS growth against its own over the same requests")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        parser.error(f"--faults {args.faults}: {', '.join(unknown)} unknown; expected "
                     f"some of {', '.join(FAULTS)}")
    cfg = SoakConfig(minutes=args.minutes, clients=args.clients, seed=args.seed,
                     tiers=args.tiers, warmup_s=args.warmup_s, faults=faults,
                     fault_every_s=tuple(args.fault_every), work_dir=args.work_dir,
                     reference_load=args.reference_load)
    model = build_tiny_llama(str(Path(tempfile.gettempdir()) / "kvoffload-soak-model"))
    result = run(cfg, model)
    print(result.table())
    if args.out is not None:
        write(args.out, result.table(), result.rows, result.faults)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
