"""The disk tier's directories: it deletes only what it created, and never through a link."""

import os

import pytest
import torch

from kvoffload_hal.config import OffloadConfig
from kvoffload_hal.tiers.dirs import MARKER
from kvoffload_hal.tiers.disk import DiskTier


def _tier(root):
    return DiskTier(str(root), rank=0, host_views=[torch.zeros(2, 64, dtype=torch.uint8)])


def test_a_directory_the_tier_did_not_create_is_never_wiped(tmp_path):
    rank_dir = tmp_path / "rank0"
    rank_dir.mkdir()
    (rank_dir / "checkpoint.bin").write_bytes(b"precious")
    with pytest.raises(ValueError, match=rf"{rank_dir}.*not empty and holds no {MARKER}"):
        _tier(tmp_path)
    assert (rank_dir / "checkpoint.bin").read_bytes() == b"precious"


def test_the_tiers_own_directory_is_emptied_at_start_up(tmp_path):
    _tier(tmp_path).shutdown()
    rank_dir = tmp_path / "rank0"
    assert (rank_dir / MARKER).exists()
    (rank_dir / "ab").mkdir()
    (rank_dir / "ab" / "ab01.kvb").write_bytes(b"stale")
    _tier(tmp_path).shutdown()
    assert sorted(os.listdir(rank_dir)) == [MARKER]


def test_a_symlinked_rank_directory_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_bytes(b"x")
    root = tmp_path / "disk"
    root.mkdir()
    (root / "rank0").symlink_to(target)
    with pytest.raises(ValueError, match="is a symbolic link"):
        _tier(root)
    assert os.listdir(target) == ["keep"]


def test_a_symlinked_disk_path_is_refused(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(ValueError, match=r"\['disk_path'\]=.*link' is a symbolic link"):
        OffloadConfig.from_extra_config({"disk_path": str(tmp_path / "link"),
                                         "disk_bytes_to_use": 1 << 20})


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_directory_owned_by_another_user_is_refused(tmp_path):
    path = tmp_path / "theirs"
    path.mkdir()
    os.chown(path, 12345, -1)
    with pytest.raises(ValueError, match="is owned by uid 12345"):
        OffloadConfig.from_extra_config({"disk_path": str(path), "disk_bytes_to_use": 1 << 20})
    root = tmp_path / "disk"
    (root / "rank0").mkdir(parents=True)
    os.chown(root / "rank0", 12345, -1)
    with pytest.raises(ValueError, match="is owned by uid 12345"):
        _tier(root)
