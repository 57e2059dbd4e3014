"""Split a bundle into parts that fit one transfer, and put it back together.

A bundle is a folder of files (wheels, a source archive). :func:`split` concatenates
them into one stream, cuts it into parts of at most ``part_bytes`` and writes
``manifest.json``: every file's name, size and sha256, and every part's. On the
other side :func:`check_part` verifies a part as it arrives, :func:`assemble`
verifies the set and writes the files back, each checked against its sha256.

Pure standard library: it runs where only Python is installed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = 1
CHUNK = 1 << 20


class BundleError(Exception):
    """A part or file is missing, the wrong size, or its sha256 does not match."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def part_name(index: int) -> str:
    return f"part-{index:03d}"


def split(src: Path, dest: Path, part_bytes: int) -> dict:
    """Cut the files of ``src`` (sorted by name) into parts under ``dest``; returns
    the manifest, also written to ``dest/manifest.json``."""
    if part_bytes < 1:
        raise ValueError(f"part_bytes={part_bytes}: expected a size of at least 1 byte")
    files = sorted(p for p in Path(src).iterdir() if p.is_file())
    if not files:
        raise BundleError(f"{src}: no files to bundle")
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("part-*"):
        old.unlink()
    manifest = {"format": FORMAT, "part_bytes": part_bytes, "files": [], "parts": []}
    writer = _PartWriter(dest, part_bytes, manifest["parts"])
    for path in files:
        manifest["files"].append({"name": path.name, "size": path.stat().st_size,
                                  "sha256": sha256_of(path)})
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(CHUNK), b""):
                writer.write(block)
    writer.close()
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


class _PartWriter:
    """Writes a byte stream into numbered parts of at most ``limit`` bytes."""

    def __init__(self, dest: Path, limit: int, record: list):
        self.dest, self.limit, self.record = dest, limit, record
        self.f = None
        self.digest = None
        self.size = 0

    def write(self, data: bytes) -> None:
        while data:
            if self.f is None or self.size == self.limit:
                self._next()
            take = data[:self.limit - self.size]
            self.f.write(take)
            self.digest.update(take)
            self.size += len(take)
            data = data[len(take):]

    def _next(self) -> None:
        self.close()
        self.f = open(self.dest / part_name(len(self.record)), "wb")
        self.digest, self.size = hashlib.sha256(), 0

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.record.append({"name": part_name(len(self.record)), "size": self.size,
                                "sha256": self.digest.hexdigest()})
            self.f = None


def load_manifest(path: Path) -> dict:
    manifest = json.loads(Path(path).read_text())
    if manifest.get("format") != FORMAT:
        raise BundleError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT}")
    return manifest


def check_part(manifest: dict, path: Path) -> None:
    """Raise :class:`BundleError` unless ``path`` is one of the manifest's parts, whole."""
    entry = {p["name"]: p for p in manifest["parts"]}.get(path.name)
    if entry is None:
        raise BundleError(f"{path.name}: not a part of this bundle")
    _check_file(path, entry)


def _check_file(path: Path, entry: dict) -> None:
    if not path.is_file():
        raise BundleError(f"{entry['name']}: missing")
    size = path.stat().st_size
    if size != entry["size"]:
        raise BundleError(f"{entry['name']}: {size} bytes, expected {entry['size']}")
    digest = sha256_of(path)
    if digest != entry["sha256"]:
        raise BundleError(f"{entry['name']}: sha256 {digest}, expected {entry['sha256']}")


def missing_parts(manifest: dict, parts_dir: Path) -> list[str]:
    return [p["name"] for p in manifest["parts"] if not (parts_dir / p["name"]).is_file()]


def assemble(manifest: dict, parts_dir: Path, dest: Path) -> list[Path]:
    """Verify every part, write the files back under ``dest`` and verify each."""
    missing = missing_parts(manifest, parts_dir)
    if missing:
        raise BundleError(f"{len(missing)} of {len(manifest['parts'])} parts missing: "
                          f"{', '.join(missing)}")
    for entry in manifest["parts"]:
        _check_file(parts_dir / entry["name"], entry)
    dest.mkdir(parents=True, exist_ok=True)
    reader = _PartReader(parts_dir, manifest["parts"])
    written = []
    for entry in manifest["files"]:
        if os.sep in entry["name"] or entry["name"] in ("", ".", ".."):
            raise BundleError(f"{entry['name']!r}: not a plain file name")
        path = dest / entry["name"]
        with open(path, "wb") as f:
            reader.copy_to(f, entry["size"])
        _check_file(path, entry)
        written.append(path)
    reader.close()
    return written


class _PartReader:
    """Reads the parts as one stream."""

    def __init__(self, parts_dir: Path, parts: list):
        self.paths = [parts_dir / p["name"] for p in parts]
        self.f = None

    def copy_to(self, out, size: int) -> None:
        while size:
            if self.f is None:
                if not self.paths:
                    raise BundleError("the parts end before the last file")
                self.f = open(self.paths.pop(0), "rb")
            block = self.f.read(min(size, CHUNK))
            if not block:
                self.f.close()
                self.f = None
                continue
            out.write(block)
            size -= len(block)

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
