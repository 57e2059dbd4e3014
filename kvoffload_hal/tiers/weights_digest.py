"""A cheap digest of a model's weights, so that kept KV blocks go stale with them.

The model's path (or hub name) and revision do not name its weights: weights
replaced in place under the same path would serve the old KV after a restart.
So the fingerprint (:mod:`~kvoffload_hal.tiers.identity`) also holds a digest
of the weight files, read at start-up without reading the weights themselves:

* the name, size and modification time (ns) of every top-level
  ``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth`` and ``*.gguf`` file (the
  patterns vLLM's loaders glob; files in subfolders are not loaded, so not
  hashed);
* the bytes of ``config.json`` and of every ``*.index.json`` (a few MB at most);
* the JSON header of every ``*.safetensors`` file (tensor names, dtypes, shapes,
  offsets: its first 8 bytes give its length, capped at
  :data:`MAX_HEADER_BYTES`); a header that cannot be read counts as absent and
  the file is named by its size and time only.

Weights changed without changing any of these (bytes rewritten with the same
size and header, then the old modification time restored, as ``cp -p``,
``rsync -t`` or ``tar`` do) are not seen: remove the tier's directories by hand
after such a change. The inode change time would see it, but a copy of the same
weights (say, into a fresh container at each start) would then lose every kept
block, so it is left out.

Where the weights are found: ``model_config.model_weights`` when it is a local
path, else ``model_config.model`` (a folder, or a single ``.gguf`` file). A hub
name is looked up in the local Hugging Face cache (``download_dir`` or the
default cache), where the snapshot vLLM loaded lies, and that folder is hashed;
a hub model with no local snapshot (weights streamed from object storage, say)
is named by its revision only, the hub revision naming the weights.

Each folder is hashed once per process (each worker calls it). Measured on a
2-core VM: 0.04 ms for the tiny test model (one 0.9 MB safetensors file and
its config), 2.5 ms for 64 shards of 5 GB with 35 KB headers each and a
5000-entry index, files in the page cache (a cold disk adds one small read
per shard).
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import os
import struct
from typing import Any

from kvoffload_hal.logger import init_logger

logger = init_logger(__name__)

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
READ_WHOLE_PATTERNS = ("*.index.json", "config.json")
# A safetensors header is JSON of a few hundred bytes per tensor; the format
# itself refuses headers over 100 MB, so a larger length means a damaged file.
MAX_HEADER_BYTES = 100 * 2**20
SAFETENSORS_LENGTH = struct.Struct("<Q")  # the header length: little-endian u64


def weights_digest(model_config: Any, download_dir: str | None = None) -> str:
    """A hex digest naming the weights ``model_config`` loads (see the module docstring)."""
    for candidate in (model_config.model_weights, model_config.model):
        if isinstance(candidate, (str, os.PathLike)) and candidate and os.path.exists(candidate):
            return local_weights_digest(os.path.realpath(candidate))
    name, revision = model_config.model, model_config.revision
    snapshot = _hub_snapshot(name, revision, download_dir) if isinstance(name, str) else None
    if snapshot is not None:
        return local_weights_digest(os.path.realpath(snapshot))
    return f"revision:{revision}"


@functools.cache
def local_weights_digest(path: str) -> str:
    """The digest of the weights in folder (or single file) ``path``, once per process."""
    digest = hashlib.sha256()
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        folder = path
    else:
        folder, names = os.path.dirname(path), [os.path.basename(path)]
    for name in names:
        weight = any(fnmatch.fnmatch(name, p) for p in WEIGHT_PATTERNS)
        whole = any(fnmatch.fnmatch(name, p) for p in READ_WHOLE_PATTERNS)
        if not (weight or whole):
            continue
        file = os.path.join(folder, name)
        try:
            st = os.stat(file)
        except OSError:
            continue
        digest.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        if whole and st.st_size <= MAX_HEADER_BYTES:
            digest.update(_read_bounded(file, st.st_size))
        elif name.endswith(".safetensors"):
            digest.update(_safetensors_header(file))
    return digest.hexdigest()


def _read_bounded(file: str, size: int) -> bytes:
    try:
        with open(file, "rb") as f:
            return f.read(size)
    except OSError as exc:
        logger.debug("weights digest: %s not read (%s): named by size and time", file, exc)
        return b""


def _safetensors_header(file: str) -> bytes:
    """The file's header bytes (length prefix included), or b"" if it cannot be read."""
    try:
        with open(file, "rb") as f:
            prefix = f.read(SAFETENSORS_LENGTH.size)
            if len(prefix) < SAFETENSORS_LENGTH.size:
                return b""
            (length,) = SAFETENSORS_LENGTH.unpack(prefix)
            if length > MAX_HEADER_BYTES:
                return b""
            return prefix + f.read(length)
    except OSError as exc:
        logger.debug("weights digest: header of %s not read (%s)", file, exc)
        return b""


def _hub_snapshot(name: str | None, revision: str | None, download_dir: str | None) -> str | None:
    """The local Hugging Face cache folder of hub model ``name`` at ``revision``, if any.

    Reads the cache only (its ``refs/`` and ``snapshots/``), never the network.
    """
    if not name:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json", cache_dir=download_dir,
                                       revision=revision)
    except Exception as exc:  # noqa: BLE001 - any failure means "not cached here"
        logger.debug("weights digest: no local snapshot of %s (%s)", name, exc)
        return None
    return os.path.dirname(found) if isinstance(found, str) else None
