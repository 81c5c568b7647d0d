"""Bytes passed on only once their block's CRC32C passed: the check on every read path.

In: a file's bytes as a stream of ``(offset, chunk)`` slices and its manifest entry (block
CRCs). Out: the same bytes handed to a consumer, block by block, each after its check;
``IntegrityError`` at the first block that fails, or at the end if bytes are missing.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import IntegrityError
from ..integrity import check_blocks
from ..manifest import FileEntry

__all__ = ["READ_CHUNK", "BlockGate", "Consumer"]

#: Files are read in slices of this size while their checksum is computed.
READ_CHUNK = 16 << 20

#: Receives a file's bytes in order: ``consume(offset, chunk)``.
Consumer = Callable[[int, memoryview], None]


class BlockGate:
    """A stream consumer that passes bytes on only once their block's CRC32C passed.

    Slices that start on a block boundary are checked where they are and passed on whole
    (the local reader's slices are whole blocks); the bytes of a block that arrives in
    pieces are gathered first (at most one block and one slice are held).
    """

    def __init__(self, entry: FileEntry, where: str, consume: Consumer | None) -> None:
        self.entry = entry
        self.where = where
        self.consume = consume
        self.verified = 0  # bytes of the file checked (and passed on) so far
        self._held = bytearray()  # bytes from `verified` on, not yet checked

    def __call__(self, offset: int, chunk: memoryview) -> None:
        """Consume the bytes ``chunk`` found at ``offset`` of the file."""
        if offset != self.verified + len(self._held):
            raise IntegrityError(f"{self.where}: bytes at {offset} arrived out of order")
        if not self._held:
            n = self._pass(offset, chunk)
            if n < len(chunk):
                self._held += chunk[n:]
            return
        self._held += chunk
        n = self._pass(self.verified, memoryview(self._held))
        del self._held[:n]

    def _pass(self, offset: int, data: memoryview) -> int:
        n = check_blocks(self.entry, offset, data, self.where)
        if n and self.consume is not None:
            self.consume(offset, data[:n])
        self.verified = offset + n
        return n

    def finish(self, got: int) -> None:
        """Check that every byte was verified (the stream ended at ``got`` bytes)."""
        if self.verified != self.entry.bytes or self._held:
            raise IntegrityError(
                f"{self.where}: read {got} bytes, of which {self.verified} verified; the "
                f"manifest says {self.entry.bytes}: it is truncated or changed while read"
            )
