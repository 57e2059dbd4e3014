"""The disk tier's block files, as a test damages them."""

import os


def flip_a_byte_of_every_block(root: str, offset: int = 100) -> None:
    """XOR one payload byte of every ``.kvb`` file under ``root`` (checksums then fail)."""
    for dirpath, _, files in os.walk(root):
        for name in (n for n in files if n.endswith(".kvb")):
            with open(os.path.join(dirpath, name), "r+b") as f:
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0x01]))
