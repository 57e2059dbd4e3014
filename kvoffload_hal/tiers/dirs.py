"""Directories of the disk tier: private, never followed through links, never someone else's.

KV reveals the prompts it was computed from, and the tier wipes its directory at
start-up, so two rules hold for every directory it uses:

* it belongs to the serving user and is not a symbolic link (checked with
  ``lstat``), so neither the files nor the wipe can be redirected elsewhere;
* the tier deletes only a directory it created itself: one holding its
  :data:`MARKER` file, or an empty one. Anything else stops start-up with one
  line naming the path.
"""

from __future__ import annotations

import os
import shutil
import stat

MARKER = ".kvoffload-hal-tier"
DIR_MODE = 0o700
FILE_MODE = 0o600


def check_private_dir(path: str, what: str) -> None:
    """Raise ``ValueError`` unless ``path`` is a real directory owned by this user."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{what}={path!r} is a symbolic link: expected a directory owned by "
                         "this user (point the setting at the link's target instead)")
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{what}={path!r} is not a directory")
    if st.st_uid != os.geteuid():
        raise ValueError(f"{what}={path!r} is owned by uid {st.st_uid}: expected a directory "
                         f"owned by this user (uid {os.geteuid()})")


def claim_tier_dir(path: str) -> None:
    """Make ``path`` an empty tier directory: create it, or empty one this tier created."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        check_private_dir(path, "disk tier directory")
        entries = os.listdir(path)
        if entries and MARKER not in entries:
            raise ValueError(
                f"disk tier directory {path!r} is not empty and holds no {MARKER} file: "
                "expected an empty directory or one this connector created; nothing was "
                "deleted") from None
        for name in entries:
            if name != MARKER:
                _remove(os.path.join(path, name))
    fd = os.open(os.path.join(path, MARKER), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW,
                 FILE_MODE)
    os.close(fd)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)  # never follows links inside
    else:
        os.unlink(path)
