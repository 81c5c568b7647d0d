"""Optional zstd compression of payload files (``.zst`` appended to the name).

Checksums in the manifest are of the bytes on disk (the compressed stream), so ``verify``
checks a file without decompressing it.
"""

from __future__ import annotations

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


def decompress(data: bytes | bytearray | memoryview, where: str) -> bytearray:
    """Decompress a whole zstd stream (one frame or more) into a new writable buffer.

    Raises:
        IntegrityError: the stream is corrupt, or truncated: a stream reader would return
            the data of an incomplete frame without complaint, so every frame must end.
    """
    out = bytearray()
    rest = memoryview(data).cast("B")
    chunk = 64 << 20
    try:
        dctx = zstandard.ZstdDecompressor()
        while True:
            dobj = dctx.decompressobj()
            pos = 0
            while not dobj.eof and pos < len(rest):
                out += dobj.decompress(rest[pos : pos + chunk])
                pos += chunk
            if not dobj.eof:
                raise IntegrityError(
                    f"{where}: zstd stream is truncated (its last frame never ends)"
                )
            tail = dobj.unused_data + bytes(rest[pos:])
            if not tail:
                return out
            rest = memoryview(tail)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{where}: zstd stream is corrupt ({e})") from None
