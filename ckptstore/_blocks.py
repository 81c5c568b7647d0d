"""Per-block CRC32C checks of payload files (the API shared with the restore path).

``FileEntry.blocks`` holds the CRC32C of each :data:`BLOCK` bytes of a file as stored
(compressed bytes for ``.zst``), the last block short. :func:`check_blocks` checks a
block-aligned range against them before its bytes are used. Where the manifest has none
(small files, older manifests), callers fall back to the whole-file CRC.
"""

from __future__ import annotations

from typing import Any

from .chunks import BLOCK
from .errors import IntegrityError
from .integrity import crc32c_of, format_crc

__all__ = ["BLOCK", "block_span", "check_blocks"]


def block_span(offset: int, length: int, size: int) -> tuple[int, int]:
    """The whole blocks around ``[offset, offset + length)`` of a file of ``size`` bytes."""
    lo = offset // BLOCK * BLOCK
    hi = min(size, -(-(offset + length) // BLOCK) * BLOCK)
    return lo, max(lo, hi)


def check_blocks(entry: Any, offset: int, data: Any, where: str) -> None:
    """Check the blocks ``data`` covers, from the block-aligned ``offset``.

    Every block must be whole, except the file's last one.

    Raises:
        IntegrityError: a block does not match, or the range is not made of whole blocks.
    """
    blocks = entry.blocks
    mv = memoryview(data).cast("B")
    if offset % BLOCK or blocks is None:
        raise IntegrityError(f"{where}: no block CRCs for bytes at {offset}")
    k = offset // BLOCK
    for i in range(0, len(mv), BLOCK):
        piece = mv[i : i + BLOCK]
        n = k + i // BLOCK
        if n >= len(blocks) or (len(piece) < BLOCK and offset + i + len(piece) != entry.bytes):
            raise IntegrityError(f"{where}: bytes {offset + i}.. are not a whole block")
        crc = crc32c_of(piece)
        if crc != blocks[n]:
            raise IntegrityError(
                f"{where}: block {n} (bytes {n * BLOCK}..) has crc32c {format_crc(crc)}, the "
                f"manifest says {format_crc(blocks[n])}; the file is corrupt"
            )
