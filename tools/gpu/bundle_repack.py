"""Repack a wheel without files a run never loads, keeping its RECORD true.

vLLM's GPU wheel carries two FlashAttention builds (``_vllm_fa2_C`` and
``_vllm_fa3_C``), a Rust frontend binary, FlashMLA and DeepGEMM builds for five
Pythons. A dense model on a Hopper GPU loads one FlashAttention build (chosen by
``VLLM_FLASH_ATTN_VERSION``; vLLM imports each build in a ``try``), and the
in-process engine never starts the Rust frontend. The dropped files leave RECORD
with them, so the wheel installs like any other.
"""

from __future__ import annotations

import fnmatch
import zipfile
from pathlib import Path

#: Files of vLLM 0.23.0's wheel a dense-model engine on an H100/H200 never loads,
#: with FlashAttention 3 (``VLLM_FLASH_ATTN_VERSION=3``).
VLLM_DROP_FA3 = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # FlashAttention 2 (imported in a try)
    "vllm/vllm-rs",  # the Rust frontend (VLLM_RUST_FRONTEND_PATH only)
    "vllm/_flashmla_C.abi3.so",  # MLA models only (imported in a try)
    "vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so",  # other Pythons than 3.12
)
#: The same with FlashAttention 2 kept instead (``VLLM_FLASH_ATTN_VERSION=2``).
VLLM_DROP_FA2 = ("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", *VLLM_DROP_FA3[1:])
DROP_SETS = {"3": VLLM_DROP_FA3, "2": VLLM_DROP_FA2}


def _dropped(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def repack(src: Path, dest: Path, patterns: tuple[str, ...]) -> list[str]:
    """Write ``dest``, a copy of wheel ``src`` without the files matching
    ``patterns``; returns the dropped names. A pattern matching nothing is an
    error: the wheel is not the one the patterns were written for."""
    with zipfile.ZipFile(src) as zin:
        names = zin.namelist()
        dropped = [n for n in names if _dropped(n, patterns)]
        unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
        if unmatched:
            raise ValueError(f"{Path(src).name}: no file matches {', '.join(unmatched)}")
        records = [n for n in names if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
        if len(records) != 1:
            raise ValueError(f"{Path(src).name}: expected one .dist-info/RECORD")
        with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zout:
            for info in zin.infolist():
                if info.filename in dropped:
                    continue
                data = zin.read(info.filename)
                if info.filename == records[0]:
                    data = _filtered_record(data, set(dropped))
                zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    return dropped


def _filtered_record(data: bytes, dropped: set[str]) -> bytes:
    lines = data.decode("utf-8").splitlines(keepends=True)
    kept = [line for line in lines if line.split(",", 1)[0] not in dropped]
    return "".join(kept).encode("utf-8")
