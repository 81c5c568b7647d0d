"""Optional zstd compression of payload files (``.zst`` appended to the name).

Checksums in the manifest are of the bytes on disk (the compressed stream), so ``verify``
checks a file without decompressing it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import zstandard

from ..errors import IntegrityError

__all__ = ["ZstdSink", "decompress"]

#: Level 1: about 1 GB/s a core with ratios of 1.1-1.4 on model weights; more costs time
#: and gains little on floating-point data.
LEVEL = 1


class ZstdSink:
    """A write-only file object compressing into another one; call :meth:`close` to finish."""

    def __init__(self, raw: Any, *, level: int = LEVEL) -> None:
        cctx = zstandard.ZstdCompressor(level=level, threads=-1, write_checksum=True)
        self._w = cctx.stream_writer(raw, closefd=False, write_return_read=True)

    def write(self, data: Any) -> int:
        """Compress ``data`` into the underlying sink."""
        return int(self._w.write(data))

    def flush(self) -> None:
        """No-op: the frame is flushed at :meth:`close`."""

    def writable(self) -> bool:
        """Always true."""
        return True

    def seekable(self) -> bool:
        """Never."""
        return False

    def close(self) -> None:
        """End the zstd frame (the underlying sink stays open)."""
        self._w.close()  # type: ignore[no-untyped-call]


#: The zstd frame magic, and the range of skippable frames' magics (RFC 8878, 3.1).
_MAGIC = 0xFD2FB528
_SKIPPABLE = 0x184D2A50
#: Most bytes one block regenerates (RFC 8878, 3.1.1.2.4: Block_Maximum_Size).
_BLOCK_MAX = 128 << 10
#: Most bytes one call into the decompressor may produce, when nothing smaller is asked.
_STEP = 64 << 20


def decompress(
    data: bytes | bytearray | memoryview,
    where: str,
    *,
    limit: int | None = None,
    why: str = "",
    declared: Callable[[bytearray], int | None] | None = None,
) -> bytearray:
    """Decompress a whole zstd stream (one frame or more) into a new writable buffer.

    Nothing is inflated past what the content may hold: a stream of a few kilobytes can
    inflate to terabytes (a decompression bomb), and its manifest entry and checksum, of
    the compressed bytes, say nothing about that. The frames' block headers are walked
    first, without decompressing, and blocks are handed to the decompressor only as far as
    the output may still grow, so at most one block (128 KiB) is inflated beyond the limit.

    Args:
        data: the compressed stream (already checked against its manifest entry).
        where: names the file in error messages.
        limit: most bytes the stream may inflate to; None for no bound.
        why: what sets ``limit``, for the message (e.g. "its tensors can take").
        declared: called with the output so far until it returns the size the content
            itself declares (a safetensors header), which then bounds it too; None while
            it needs more bytes (blocks are then inflated one at a time).

    Returns:
        The decompressed bytes.

    Raises:
        IntegrityError: the stream is corrupt, or truncated (a stream reader would return
            the data of an incomplete frame without complaint, so every frame must end), or
            it inflates past ``limit`` or past what ``declared`` returned.
    """
    out = bytearray()
    caps = [(limit, why)] if limit is not None else []
    waiting = declared is not None

    def room() -> int:
        """How many more bytes may come before the caps are checked again."""
        if waiting:
            return 1  # one block at a time until the content has declared its size
        return min((cap + 1 - len(out) for cap, _ in caps), default=_STEP)

    for piece in _inflate(memoryview(data).cast("B"), where, room):
        out += piece
        if waiting:
            assert declared is not None
            size = declared(out)
            if size is not None:
                caps.append((size, "its own header declares"))
                waiting = False
        for cap, what in caps:
            if len(out) > cap:
                raise IntegrityError(
                    f"{where}: zstd stream inflates past the {cap} bytes {what}; refused "
                    "without inflating the rest (a corrupt file, or a decompression bomb). "
                    "Restore an earlier step"
                )
    return out


def _inflate(mv: memoryview, where: str, room: Callable[[], int]) -> Iterator[bytes]:
    """The output of the frames in ``mv``, in pieces of at most about ``room()`` bytes."""
    truncated = IntegrityError(f"{where}: zstd stream is truncated (its last frame never ends)")
    n = len(mv)
    pos = 0
    if n == 0:
        raise truncated
    dctx = zstandard.ZstdDecompressor()
    while pos < n:
        if n - pos < 8 and _MAGIC.to_bytes(4, "little").startswith(bytes(mv[pos : pos + 4])):
            raise truncated
        magic = int.from_bytes(mv[pos : pos + 4], "little")
        if magic & 0xFFFFFFF0 == _SKIPPABLE:  # user data that decoders skip
            if n - pos < 8:
                raise truncated
            pos += 8 + int.from_bytes(mv[pos + 4 : pos + 8], "little")
            if pos > n:
                raise truncated
            continue
        if magic != _MAGIC:
            raise IntegrityError(
                f"{where}: zstd stream is corrupt (no zstd frame at byte {pos}: bad magic "
                f"{magic:#010x})"
            )
        fhd = mv[pos + 4]
        if fhd & 0x08:
            raise IntegrityError(
                f"{where}: zstd stream is corrupt (reserved bit set in the frame header "
                f"at byte {pos})"
            )
        single = bool(fhd & 0x20)
        fcs = (1 if single else 0, 2, 4, 8)[fhd >> 6]
        has_checksum = bool(fhd & 0x04)
        q = pos + 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 0x03] + fcs
        dobj = dctx.decompressobj()
        start = pos
        last = False
        while not last:
            # Hand over whole blocks, as many as the output may still grow by (at least
            # one): raw and RLE blocks say how much they regenerate, a compressed block at
            # most 128 KiB.
            budget = max(1, min(room(), _STEP))
            bound = 0
            while not last and (bound < budget or q == start):
                if q + 3 > n:
                    raise truncated
                head = int.from_bytes(mv[q : q + 3], "little")
                last = bool(head & 1)
                kind, size = (head >> 1) & 3, head >> 3
                if kind == 3:
                    raise IntegrityError(
                        f"{where}: zstd stream is corrupt (reserved block type at byte {q})"
                    )
                q += 3 + (1 if kind == 1 else size)
                bound += _BLOCK_MAX if kind == 2 else size
                if q > n:
                    raise truncated
            if last and has_checksum:
                q += 4
                if q > n:
                    raise truncated
            try:
                piece = dobj.decompress(mv[start:q])
            except zstandard.ZstdError as e:
                raise IntegrityError(f"{where}: zstd stream is corrupt ({e})") from None
            start = q
            if piece:
                yield piece
        if not dobj.eof or dobj.unused_data:
            raise IntegrityError(
                f"{where}: zstd stream is corrupt (the frame at byte {pos} does not end where "
                "its last block does)"
            )
        pos = q
