"""The self-describing value a secondary tier stores for one block.

A header, the block key (ASCII), then the payload: the block's bytes in every
host region, in region order. The header holds a magic naming the tier's
format, a format version, a CRC-32, the key length, a reserved field, the
writer's :func:`~kvoffload_hal.tiers.identity.kv_fingerprint` and the payload
length. The CRC covers everything after its own field: the rest of the header,
the key and the payload. A read accepts a value only if every field matches:
anything else (a torn, short or foreign value, one written for another key)
fails that key, which vLLM recomputes.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable

from kvoffload_hal.tiers.identity import FINGERPRINT_BYTES

# magic, version, crc32, key bytes, reserved, fingerprint, payload bytes
HEADER = struct.Struct(f"<8sIIHH{FINGERPRINT_BYTES}sQ")
CRC_FROM = 16  # the CRC covers the header after its own field, the key and the payload

Bytes = bytes | bytearray | memoryview


class BlockValueFormat:
    """Writes and checks the header of one tier's values (its magic and version)."""

    def __init__(self, magic: bytes, version: int, fingerprint: bytes,
                 payload_bytes: int) -> None:
        if len(fingerprint) != FINGERPRINT_BYTES:
            raise ValueError(f"fingerprint of {len(fingerprint)} bytes, expected "
                             f"{FINGERPRINT_BYTES}")
        self.magic, self.version = magic, version
        self.fingerprint = fingerprint
        self.payload_bytes = payload_bytes

    def header(self, key_bytes: bytes, payload: Iterable[Bytes]) -> bytes:
        """The header of ``key_bytes`` + ``payload`` (the payload's parts, in order)."""
        fields = (len(key_bytes), 0, self.fingerprint, self.payload_bytes)
        covered = HEADER.pack(self.magic, self.version, 0, *fields)[CRC_FROM:]
        crc = _crc(covered, key_bytes, payload)
        return HEADER.pack(self.magic, self.version, crc, *fields)

    @staticmethod
    def lengths(header: Bytes) -> tuple[int, int]:
        """(key bytes, payload bytes) as a header says: where to find them in a value."""
        fields = HEADER.unpack_from(header)
        return fields[3], fields[6]

    def problem(self, header: Bytes, stored_key: Bytes, key_bytes: bytes,
                payload: list[Bytes]) -> str | None:
        """Why the value read is unusable for ``key_bytes``, or None when it is sound.

        ``stored_key`` is the key the value carries (as long as its header says);
        ``payload`` is what was read after it, in parts.
        """
        if len(header) < HEADER.size:
            return "shorter than its header"
        magic, version, crc, _, _, fingerprint, length = HEADER.unpack_from(header)
        if magic != self.magic or version != self.version:
            return "unknown header"
        if bytes(stored_key) != key_bytes:
            return "written for another key"
        if fingerprint != self.fingerprint:
            return "written by another model, KV layout or rank"
        read = sum(len(part) for part in payload)
        if length != self.payload_bytes or read != length:
            return (f"{length} payload bytes in its header, {read} read, expected "
                    f"{self.payload_bytes}")
        if _crc(bytes(header[CRC_FROM:HEADER.size]), key_bytes, payload) != crc:
            return "checksum mismatch"
        return None


def _crc(covered: bytes, key_bytes: bytes, payload: Iterable[Bytes]) -> int:
    crc = zlib.crc32(key_bytes, zlib.crc32(covered))
    for part in payload:
        crc = zlib.crc32(part, crc)
    return crc
