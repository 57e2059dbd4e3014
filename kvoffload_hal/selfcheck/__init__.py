"""``python -m kvoffload_hal.selfcheck [--backend auto|cuda|npu|cpu] [--json]``.

A one-command check that the copy backend works on this machine:

* which backend is chosen and why, the driver/runtime version, the copy path
  (batch or loop fallback);
* byte-exact round trips of scattered blocks, device -> host then host ->
  device into other blocks, over several KV layouts (vLLM's one-tensor
  layouts, vllm-ascend's ``(k, v)`` and MLA ``(nope, rope)`` tuples, padded
  blocks) and block sizes, checking that nothing else was touched;
* D2H and H2D GB/s of scattered blocks against one contiguous copy of as many
  bytes through the same backend (the limit);
* one verdict line. The exit status is 0 on PASS, 1 when a copy was wrong or
  failed, 2 when no backend could be set up.

:func:`run_selfcheck` takes a backend factory, so tests run the same checks on
backends built over fake driver libraries (whose "device" memory is host memory).
A factory rather than one backend object, because a backend is bound once and
each check binds its own KV tensors.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch

from kvoffload_hal.hal.backend import DmaCopyBackend
from kvoffload_hal.hal.registry import BackendSelectionError, backend_names, get_backend_class
from kvoffload_hal.logger import init_logger
from kvoffload_hal.selfcheck.bandwidth import Bandwidth, measure_bandwidth
from kvoffload_hal.selfcheck.environment import (
    Selection,
    choose_backend,
    default_device,
    describe_environment,
)
from kvoffload_hal.selfcheck.kv_layouts import LAYOUTS, NUM_LAYERS
from kvoffload_hal.selfcheck.report import render_text, verdict
from kvoffload_hal.selfcheck.roundtrip import (
    NUM_COPIED_BLOCKS,
    NUM_DEVICE_BLOCKS,
    NUM_HOST_BLOCKS,
    RoundTrip,
    check_round_trip,
)

__all__ = ["main", "run_selfcheck"]

logger = init_logger(__name__)

#: Tokens per block of the round trips: vLLM's default and a large Ascend one.
BLOCK_SIZES = (16, 128)
#: Bytes of each bandwidth job (scattered and contiguous alike).
DEFAULT_BANDWIDTH_MIB = 128

EXIT_PASS, EXIT_FAIL, EXIT_SETUP = 0, 1, 2


class _Recorder:
    """Wraps a backend factory and remembers the last backend it built."""

    def __init__(self, make: Callable[[], DmaCopyBackend]) -> None:
        self.make, self.last = make, None

    def __call__(self) -> DmaCopyBackend:
        self.last = self.make()
        return self.last


def _trip_dict(t: RoundTrip) -> dict:
    return {**asdict(t), "ok": t.ok}


def _bandwidth_dict(b: Bandwidth | None) -> dict | None:
    return None if b is None else {**asdict(b), "total_bytes": b.total_bytes}


def _selection_failed(reason: str) -> dict:
    result = {"ok": False, "backend": None, "reason": None, "environment": None,
              "round_trips": [], "bandwidth": None, "error": reason}
    result["verdict"] = verdict(result)
    return result


def run_selfcheck(backend: str | None = None, *,
                  make_backend: Callable[[], DmaCopyBackend] | None = None,
                  device: torch.device | str | None = None,
                  block_sizes: Sequence[int] = BLOCK_SIZES,
                  layouts: Sequence[str] | None = None,
                  bandwidth_mib: float = DEFAULT_BANDWIDTH_MIB, seed: int = 0) -> dict:
    """Run every check; return the result as plain JSON values (``result["ok"]``).

    ``backend`` is a registry name (default: ``$KVOFFLOAD_HAL_BACKEND``, else
    ``auto``). ``make_backend`` replaces the registry: it must return a new,
    unbound backend at each call, and the KV tensors then live on ``device``
    (default: the CPU, as with the fake driver libraries of the tests).
    ``bandwidth_mib=0`` skips the bandwidth measurement.
    """
    if make_backend is None:
        try:
            selection = choose_backend(backend)
            cls = get_backend_class(selection.name)
            tensor_device = torch.device(device) if device is not None else default_device(
                selection.name)
        except BackendSelectionError as e:
            return _selection_failed(str(e))
        recorder = _Recorder(lambda: cls(tensor_device))
    else:
        selection = Selection(backend or "injected", "backend factory given by the caller")
        tensor_device = torch.device(device if device is not None else "cpu")
        recorder = _Recorder(make_backend)
    logger.info("kvoffload_hal selfcheck: %s backend on %s", selection.name, tensor_device)
    start = time.perf_counter()
    trips = [check_round_trip(recorder, layout, size, tensor_device, seed + k)
             for k, (layout, size) in enumerate((lay, s) for lay in (layouts or LAYOUTS)
                                                for s in block_sizes)]
    bw = None
    if bandwidth_mib > 0:
        bw = measure_bandwidth(recorder, tensor_device, int(bandwidth_mib * 2**20), seed=seed)
    name = recorder.last.name if recorder.last is not None and recorder.last.name else (
        selection.name)
    result = {
        "backend": name, "reason": selection.reason,
        "environment": describe_environment(recorder.last, tensor_device),
        "round_trip_params": {"device_blocks": NUM_DEVICE_BLOCKS, "host_blocks": NUM_HOST_BLOCKS,
                              "copied_blocks": NUM_COPIED_BLOCKS, "layers": NUM_LAYERS},
        "round_trips": [_trip_dict(t) for t in trips],
        "bandwidth": _bandwidth_dict(bw), "error": None,
        "seconds": round(time.perf_counter() - start, 2),
    }
    result["ok"] = all(t.ok for t in trips) and (bw is None or bw.ok)
    result["verdict"] = verdict(result)
    return result


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"--bandwidth-mib must be >= 0, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvoffload_hal.selfcheck",
        description="Check that the KV offload copy backend works here: byte-exact round "
                    "trips of scattered blocks and their bandwidth against one contiguous copy.")
    parser.add_argument("--backend", default=None,
                        help=f"one of {', '.join(backend_names())} (default: "
                             f"$KVOFFLOAD_HAL_BACKEND, else auto)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--device", default=None,
                        help="device of the KV tensors, e.g. cuda:1 (default: the current one)")
    parser.add_argument("--bandwidth-mib", type=_non_negative, default=DEFAULT_BANDWIDTH_MIB,
                        help="MiB per bandwidth job; 0 skips the measurement "
                             f"(default {DEFAULT_BANDWIDTH_MIB})")
    parser.add_argument("--seed", type=int, default=0, help="seed of block ids and bytes")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (see the module docstring)."""
    args = _parser().parse_args(argv)
    result = run_selfcheck(args.backend, device=args.device, bandwidth_mib=args.bandwidth_mib,
                           seed=args.seed)
    print(json.dumps(result, indent=2) if args.json else render_text(result), flush=True)
    if result.get("error"):
        return EXIT_SETUP
    return EXIT_PASS if result["ok"] else EXIT_FAIL
