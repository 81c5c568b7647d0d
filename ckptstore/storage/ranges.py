"""Byte ranges of a committed step's files (partial loads, resharded restores).

In: a step, its manifest's file table, and ``(name, offset, length)`` requests. Out:
exactly those bytes, each file opened once and its size checked against the manifest; the
caller checks each range against its block CRCs. Object stores subclass
:class:`RangeReader` to make each read one ranged GET (``remote``).
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Mapping
from typing import IO

from ..errors import IntegrityError
from ..manifest import FileEntry
from .protocols import FileSource

__all__ = ["RangeReader"]


class RangeReader:
    """Reads byte ranges of a committed checkpoint's files, each file opened once.

    A file's size is checked against the manifest when it is opened. The bytes are not
    checked here: callers check each range against its chunk CRCs (``chunks.read_box``).
    Use as a context manager; ``read(name, offset, length)`` returns exactly ``length``
    bytes or raises :class:`IntegrityError`.
    """

    def __init__(self, storage: FileSource, step: int, files: Mapping[str, FileEntry]) -> None:
        self.storage = storage
        self.step = step
        self.files = files
        self.bytes_read = 0
        self._open: dict[str, IO[bytes]] = {}
        self._lock = threading.Lock()

    def _file(self, name: str) -> IO[bytes]:
        f = self._open.get(name)
        if f is not None:
            return f
        where = self.storage.describe(self.step, name)
        entry = self.files.get(name)
        if entry is None:
            raise IntegrityError(f"{where}: not listed in the manifest")
        size = self.storage.file_size(self.step, name)
        if size != entry.bytes:
            raise IntegrityError(
                f"{where}: file has {size} bytes, manifest says {entry.bytes}; "
                "it is truncated, missing or replaced"
            )
        f = self.storage.open_file(self.step, name)
        self._open[name] = f
        return f

    def check_size(self, name: str) -> None:
        """Check ``name``'s size against the manifest now (it is opened for the reads).

        A restore checks every file it will read before it makes its targets: a forged
        manifest or rank table that claims terabytes for a small file is refused before
        tensors of that size are allocated.

        Raises:
            IntegrityError: not listed, or not the size the manifest says.
        """
        with self._lock:
            self._file(name)

    def read(self, name: str, offset: int, length: int) -> bytearray:
        """``length`` bytes of ``name`` from ``offset``, in a new buffer.

        The range is checked against the file's size (itself checked against the manifest)
        before the buffer is made: a forged index asking for terabytes gets an error, not
        a zero-filled buffer of that size.
        """
        self.check_size(name)
        size = self.files[name].bytes
        if offset < 0 or length < 0 or offset + length > size:
            where = self.storage.describe(self.step, name)
            raise IntegrityError(
                f"{where}: {length} bytes at {offset} run past the file ({size} bytes)"
            )
        buf = bytearray(length)
        self.read_into(name, offset, [memoryview(buf)])
        return buf

    def read_into(self, name: str, offset: int, bufs: list[memoryview]) -> None:
        """Fill ``bufs``, one after another, with the bytes of ``name`` from ``offset`` on.

        The bytes go straight into the caller's memory (a restore's target tensors), with no
        buffer of our own in between.
        """
        where = self.storage.describe(self.step, name)
        total = sum(len(b) for b in bufs)
        got = 0
        try:
            fd: int | None = None
            with self._lock:
                f = self._file(name)
                try:
                    fd = f.fileno()
                except (AttributeError, io.UnsupportedOperation):  # not an OS file
                    got = self._read_seq(f, offset, bufs)
            if fd is not None:
                # pread: no shared file position, so several threads read one file at once.
                for b in bufs:
                    done = 0
                    while done < len(b):
                        n = os.preadv(fd, [b[done:]], offset + got + done)
                        if not n:
                            break
                        done += n
                    got += done
                    if done < len(b):
                        break
        except OSError as e:
            raise IntegrityError(f"{where}: unreadable ({e})") from None
        if got != total:
            raise IntegrityError(f"{where}: {total} bytes at {offset} not there; it is truncated")
        self.bytes_read += total

    @staticmethod
    def _read_seq(f: IO[bytes], offset: int, bufs: list[memoryview]) -> int:
        """Fill ``bufs`` from ``f`` through its file position (callers hold the lock)."""
        f.seek(offset)
        got = 0
        for b in bufs:
            done = 0
            while done < len(b):
                n = f.readinto(b[done:])  # type: ignore[attr-defined]
                if not n:
                    break
                done += n
            got += done
            if done < len(b):
                break
        return got

    def read_mode(self) -> str | None:
        """How a restore reads its runs of a file (``sharded/extents.py``); once a restore.

        ``"direct"`` (through :meth:`direct_fd`), ``"buffered"``, or None where the store
        offers no choice (object stores: every read is a ranged GET).
        """
        return None

    def direct_fd(self, name: str) -> int | None:
        """An ``O_DIRECT`` descriptor of ``name``, kept open until :meth:`close`; or None.

        The file's size is checked against the manifest first.
        """
        return None

    def record_read(self, mode: str, nbytes: int, seconds: float) -> None:
        """Note that a restore read ``nbytes`` in ``mode`` in ``seconds``.

        The measurement a store that chooses between the modes by speed keeps (``iomode``).
        """

    def close(self) -> None:
        """Close every opened file."""
        for f in self._open.values():
            with contextlib.suppress(OSError):
                f.close()
        self._open.clear()

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
