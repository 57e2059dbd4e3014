"""Splitting a bundle into parts, checking parts as they arrive, putting it back."""

import json
import os

import bundle_parts
import pytest
from bundle_parts import BundleError


def _bundle(tmp_path, sizes=(2500, 10, 0, 4096)):
    src = tmp_path / "payload"
    src.mkdir()
    for i, size in enumerate(sizes):
        (src / f"f{i}.bin").write_bytes(os.urandom(size))
    return src


def test_split_then_assemble_gives_back_every_byte(tmp_path):
    src = _bundle(tmp_path)
    manifest = bundle_parts.split(src, tmp_path / "parts", part_bytes=1000)
    sizes = [p["size"] for p in manifest["parts"]]
    assert all(s <= 1000 for s in sizes) and sum(sizes) == 2500 + 10 + 4096
    assert len(sizes) == 7  # 6606 bytes in parts of 1000
    assert json.loads((tmp_path / "parts" / "manifest.json").read_text()) == manifest
    out = bundle_parts.assemble(manifest, tmp_path / "parts", tmp_path / "out")
    assert sorted(p.name for p in out) == sorted(p.name for p in src.iterdir())
    for path in out:
        assert path.read_bytes() == (src / path.name).read_bytes()


def test_a_damaged_part_is_named(tmp_path):
    manifest = bundle_parts.split(_bundle(tmp_path), tmp_path / "parts", part_bytes=1000)
    part = tmp_path / "parts" / "part-003"
    data = bytearray(part.read_bytes())
    data[17] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="part-003: sha256"):
        bundle_parts.check_part(manifest, part)
    with pytest.raises(BundleError, match="part-003: sha256"):
        bundle_parts.assemble(manifest, tmp_path / "parts", tmp_path / "out")


def test_missing_and_short_parts_are_named(tmp_path):
    manifest = bundle_parts.split(_bundle(tmp_path), tmp_path / "parts", part_bytes=1000)
    (tmp_path / "parts" / "part-001").unlink()
    (tmp_path / "parts" / "part-005").unlink()
    assert bundle_parts.missing_parts(manifest, tmp_path / "parts") == ["part-001", "part-005"]
    with pytest.raises(BundleError, match="2 of 7 parts missing: part-001, part-005"):
        bundle_parts.assemble(manifest, tmp_path / "parts", tmp_path / "out")
    short = tmp_path / "parts" / "part-002"
    short.write_bytes(short.read_bytes()[:-1])
    with pytest.raises(BundleError, match="part-002: 999 bytes, expected 1000"):
        bundle_parts.check_part(manifest, short)


def test_a_part_of_another_bundle_is_refused(tmp_path):
    manifest = bundle_parts.split(_bundle(tmp_path), tmp_path / "parts", part_bytes=1000)
    stranger = tmp_path / "part-999"
    stranger.write_bytes(b"x")
    with pytest.raises(BundleError, match="not a part of this bundle"):
        bundle_parts.check_part(manifest, stranger)


def test_a_new_split_leaves_no_stale_parts(tmp_path):
    src = _bundle(tmp_path)
    bundle_parts.split(src, tmp_path / "parts", part_bytes=500)
    manifest = bundle_parts.split(src, tmp_path / "parts", part_bytes=4000)
    assert sorted(p.name for p in (tmp_path / "parts").glob("part-*")) == [
        p["name"] for p in manifest["parts"]]


def test_bad_arguments_say_what_was_expected(tmp_path):
    with pytest.raises(ValueError, match="part_bytes=0: expected a size of at least 1"):
        bundle_parts.split(_bundle(tmp_path), tmp_path / "parts", part_bytes=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(BundleError, match="no files to bundle"):
        bundle_parts.split(tmp_path / "empty", tmp_path / "parts", part_bytes=10)
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps({"format": 99}))
    with pytest.raises(BundleError, match="format 99, expected 1"):
        bundle_parts.load_manifest(bad)
