"""Small wheels built on the spot: the bundle's tools are tested without a network."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def make_wheel(dest: Path, name: str, version: str, requires: tuple[str, ...] = (),
               files: dict[str, bytes] | None = None, tag: str = "py3-none-any") -> Path:
    """A wheel of ``name`` holding ``files`` (default: a module ``<name>`` that
    records its version) with ``Requires-Dist`` lines ``requires``."""
    mod = name.replace("-", "_")
    files = dict(files or {f"{mod}/__init__.py": f"VERSION = {version!r}\n".encode()})
    info = f"{mod}-{version}.dist-info"
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                    *(f"Requires-Dist: {r}\n" for r in requires)])
    files[f"{info}/METADATA"] = meta.encode()
    files[f"{info}/WHEEL"] = (f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              f"Tag: {tag}\n").encode()
    record = "".join(_record_line(n, d) for n, d in files.items()) + f"{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record.encode()
    path = Path(dest) / f"{mod}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for n, d in files.items():
            zf.writestr(n, d)
    return path
