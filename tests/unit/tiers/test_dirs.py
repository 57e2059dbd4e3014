"""The disk tier's directories: one per running server, private, never someone else's."""

import os
import subprocess
import sys

import pytest
import torch

from kvoffload_hal.config import OffloadConfig
from kvoffload_hal.tiers.disk.dirs import LOCK, MARKER, TierDir
from kvoffload_hal.tiers.disk.worker import DiskTier
from support.polling import collect_results


def _tier(root, fill=0):
    return DiskTier(str(root), rank=0, host_views=[torch.full((2, 64), fill, dtype=torch.uint8)])


def _ours(root):
    return sorted(p.name for p in root.iterdir() if (p / MARKER).exists())


def test_servers_on_one_disk_path_never_share_files(tmp_path):
    first, second = _tier(tmp_path, fill=1), _tier(tmp_path, fill=2)
    assert first.root != second.root and len(_ours(tmp_path)) == 2
    for tier in (first, second):  # the same key: the same tokens under two models
        tier.submit_store(0, [("ab01", 0)])
        assert collect_results(tier.poll, 1)[0].ok
    for tier, fill in ((first, 1), (second, 2)):
        tier.views[0][1].zero_()
        tier.submit_load(1, [("ab01", 1)])
        assert collect_results(tier.poll, 1)[0].ok
        assert (tier.views[0][1] == fill).all()  # its own bytes, not the other server's
    first.shutdown()
    second.shutdown()
    assert _ours(tmp_path) == []  # a clean shutdown removes its own directory


def test_directories_of_stopped_servers_are_removed_at_start_up(tmp_path):
    # A server killed without shutdown: its directory stays, its lock dies with it.
    code = ("import os, sys; from kvoffload_hal.tiers.disk.dirs import TierDir; "
            "d = TierDir(sys.argv[1], 0); open(os.path.join(d.path, 'x.kvb.1.tmp'), 'w'); "
            "os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)
    (dead,) = _ours(tmp_path)
    running = TierDir(str(tmp_path), 0)
    assert _ours(tmp_path) == sorted([os.path.basename(running.path)])  # the dead one went
    later = TierDir(str(tmp_path), 0)
    assert os.path.isdir(running.path)  # a running server's directory is left alone
    later.close(remove=True)
    running.close(remove=True)
    assert _ours(tmp_path) == []


def test_a_directory_the_tier_did_not_create_is_never_touched(tmp_path):
    theirs = tmp_path / "rank0.checkpoint"
    theirs.mkdir()
    (theirs / LOCK).write_bytes(b"")  # looks like ours, but holds no marker
    (theirs / "weights.bin").write_bytes(b"precious")
    _tier(tmp_path).shutdown()
    assert sorted(os.listdir(theirs)) == [LOCK, "weights.bin"]


def test_a_symlink_in_disk_path_is_never_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / MARKER).write_bytes(b"")
    (target / "keep").write_bytes(b"x")
    root = tmp_path / "disk"
    root.mkdir()
    (root / "rank0.link").symlink_to(target)
    _tier(root).shutdown()
    assert sorted(os.listdir(target)) == sorted([MARKER, "keep"])
    assert (root / "rank0.link").is_symlink()


def test_a_symlinked_disk_path_is_refused(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(ValueError, match=r"\['disk_path'\]=.*link' is a symbolic link"):
        OffloadConfig.from_extra_config({"disk_path": str(tmp_path / "link"),
                                         "disk_bytes_to_use": 1 << 20})
    with pytest.raises(ValueError, match="is a symbolic link"):
        _tier(tmp_path / "link")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_directories_owned_by_another_user_are_refused_or_left_alone(tmp_path):
    path = tmp_path / "theirs"
    path.mkdir()
    os.chown(path, 12345, -1)
    with pytest.raises(ValueError, match="is owned by uid 12345"):
        OffloadConfig.from_extra_config({"disk_path": str(path), "disk_bytes_to_use": 1 << 20})
    root = tmp_path / "disk"
    stale = root / "rank0.other"
    stale.mkdir(parents=True)
    (stale / MARKER).write_bytes(b"")
    os.chown(stale, 12345, -1)
    _tier(root).shutdown()
    assert (stale / MARKER).exists()
