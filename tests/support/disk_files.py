"""The disk tier's block files, as a test damages them."""

import os


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _block_files(root: str):
    for dirpath, _, files in os.walk(root):
        yield from (os.path.join(dirpath, n) for n in files if n.endswith(".kvb"))


def flip_a_byte_of_every_block(root: str, offset: int = 100) -> None:
    """XOR one payload byte of every ``.kvb`` file under ``root`` (checksums then fail)."""
    for path in _block_files(root):
        _flip(path, offset)


def flip_a_byte_of_block(root: str, block_hash, offset: int = 100) -> None:
    """The same, for the file of one block of KV cache group 0 (vLLM's block hash)."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    name = make_block_hash_with_group_id(block_hash, 0).hex() + ".kvb"
    found = [p for p in _block_files(root) if os.path.basename(p) == name]
    assert len(found) == 1, f"{name}: {len(found)} files under {root}"
    _flip(found[0], offset)
