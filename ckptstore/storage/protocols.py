"""The small interfaces the storage modules share (not a stage).

:class:`ChecksummingWriter` (what ``Pending.open`` yields), :class:`WriterLock` (a store's
writer lock), and the parts of a :class:`~ckptstore.storage.base.Storage` that the reading
and deleting helpers use (:class:`FileSource`, :class:`TreeRemover`), so that those helpers
live in modules of their own without importing the base class that imports them.
"""

from __future__ import annotations

from typing import IO, Any, Protocol

__all__ = ["ChecksummingWriter", "FileSource", "PendingStore", "TreeRemover", "WriterLock"]


class ChecksummingWriter(Protocol):
    """A file object that computes the CRC32C and size of what it writes."""

    crc: int
    nbytes: int
    #: Per-block CRC32Cs (``FileEntry.blocks``); ``None`` for a file of one block or less.
    blocks: tuple[int, ...] | None

    def write(self, data: Any, /) -> int:
        """Write and checksum ``data``."""
        ...


class WriterLock(Protocol):
    """The store's writer lock: acquired without waiting, held until released."""

    @property
    def is_locked(self) -> bool:
        """Whether this process holds it."""
        ...

    def acquire(self, timeout: float = 0, *, maintenance_wait: float = 0.0) -> None:
        """Take the lock or raise StoreLockedError.

        A maintenance command holding it is waited for up to ``maintenance_wait`` seconds.
        """
        ...

    def acquire_maintenance(self) -> None:
        """Take the lock for a maintenance command (a job's first save waits for it)."""
        ...

    def release(self) -> None:
        """Give it back."""
        ...


class FileSource(Protocol):
    """What a :class:`~ckptstore.storage.ranges.RangeReader` reads a step's files through."""

    def describe(self, step: int | None = None, name: str | None = None) -> str:
        """A human-readable location for messages."""
        ...

    def file_size(self, step: int, name: str) -> int | None:
        """The size of a file of a committed step (None: missing)."""
        ...

    def open_file(self, step: int, name: str) -> IO[bytes]:
        """Open a file of a committed step for reading."""
        ...


class PendingStore(Protocol):
    """The write primitives of a store that a :class:`~ckptstore.storage.pending.Pending` uses."""

    root: str

    def describe(self, step: int | None = None, name: str | None = None) -> str:
        """A human-readable location for messages."""
        ...

    def _open_write(self, rel: str) -> IO[bytes]: ...

    def _finish_write(self, f: IO[bytes], rel: str) -> None: ...

    def _open_read(self, rel: str) -> IO[bytes]: ...

    def _put_small(self, rel: str, data: bytes) -> None: ...


class TreeRemover(Protocol):
    """What the background deleter removes trash with."""

    def describe(self, step: int | None = None, name: str | None = None) -> str:
        """A human-readable location for messages."""
        ...

    def _fsync_dir(self, rel: str) -> None: ...

    def _rmtree(self, rel: str) -> None: ...
