"""A checkpoint being written: the files of a step before its commit.

In: the store (its write primitives) and the tmp directory ``Storage.begin`` made. Out:
payload files, each checksummed on its way to the disk and durable once its ``open``
block ends, recorded in :attr:`Pending.files` for the manifest. The commit itself (the
order that makes the step visible) is the storage base's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import cast

from ..errors import CommitError
from ..integrity import CRCWriter
from ..manifest import MAX_JSON_FILE_BYTES, FileEntry, validate_payload_name
from .protocols import ChecksummingWriter, PendingStore

__all__ = ["Pending"]


class Pending:
    """A checkpoint being written: a directory that readers never look at.

    On a local filesystem it is ``.tmp-step-N-<uuid>/``; on a store without rename it is
    ``step-N/`` itself, invisible until its manifest is put (or, when it replaces a corrupt
    committed ``step-N``, a ``.tmp-`` prefix that is copied into place at commit).
    """

    def __init__(
        self, storage: PendingStore, step: int, dirname: str, *, replace: bool = False
    ) -> None:
        self.storage = storage
        self.step = step
        self.dirname = dirname
        #: The save replaces a committed (corrupt) ``step-N``, which stays until the commit.
        self.replace = replace
        self.files: dict[str, FileEntry] = {}
        #: The commit's manifest put (a store without rename) was issued: it may land
        #: whatever this process saw of it (a Ctrl-C ends the wait, not the request), so
        #: ``abort`` leaves ``step-N/`` to ``gc``, which takes it only if it stayed unseen.
        self.in_doubt = False
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def open(
        self, name: str, *, codec: str, compression: str | None = None, rank: int | None = None
    ) -> Iterator[ChecksummingWriter]:
        """Open a new payload file; on clean exit it is durable and in :attr:`files`.

        The yielded writer checksums every byte on its way to the file.
        """
        validate_payload_name(name)
        if name in self.files:
            raise CommitError(f"file {name!r} written twice into step {self.step}")
        rel = f"{self.dirname}/{name}"
        f = self.storage._open_write(rel)
        try:
            # A backend writer that checksums on its own (DirectWriter) is used as is;
            # anything else is wrapped so the CRC is still computed on the way out.
            # (Attribute checks, not isinstance on the runtime Protocol: that costs ~0.1 ms.)
            checksums = hasattr(f, "crc") and hasattr(f, "nbytes")
            w = cast(ChecksummingWriter, f if checksums else CRCWriter(f))
            yield w
            self.storage._finish_write(f, rel)
        except BaseException:
            with contextlib.suppress(OSError):
                abort = getattr(f, "abort", None)
                (abort or f.close)()  # never fsync or finish a file that failed
            raise
        with self._lock:
            self.files[name] = FileEntry(w.nbytes, w.crc, codec, compression, rank, w.blocks)

    def write_bytes(self, name: str, data: bytes, *, codec: str, rank: int | None = None) -> None:
        """Write a small file in one go.

        Raises:
            CommitError: a JSON file larger than any reader reads (:data:`MAX_JSON_FILE_BYTES`).
        """
        if codec == "json" and len(data) > MAX_JSON_FILE_BYTES:
            raise CommitError(
                f"{name} would be {len(data)} bytes of JSON, more than the {MAX_JSON_FILE_BYTES} "
                "a checkpoint may hold in one: store large plain data (long lists of numbers) "
                "as tensors"
            )
        with self.open(name, codec=codec, rank=rank) as w:
            w.write(data)
