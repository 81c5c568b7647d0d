"""Copying a committed step's files between two stores, every byte checked on the way.

:func:`copy_files` streams files from one store into another's pending step, several at
once, each checked against its manifest entry as it leaves and as it lands; the uploader
(:mod:`ckptstore.tiers.replica`), the node-local fill and :func:`fetch_step` (a replica step
copied into the local store with the local commit protocol) are built on it.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Collection

from .._log import logger as log
from ..errors import (
    IntegrityError,
    ReplicaError,
)
from ..manifest import FileEntry, Manifest
from ..storage import LocalStorage, Pending, Storage, iomode
from ..storage.reach import is_unreachable
from .safety import mark_replicated
from .uploadgate import UploadGate

__all__ = ["DEFAULT_THREADS", "copy_files", "fetch_step"]

#: Files uploaded (or downloaded) at once per step.
DEFAULT_THREADS = 4
#: Attempts per step before the upload is given up until the next save or ``retry()``.
_ATTEMPTS = 3
#: Seconds before the second attempt; doubled for each further one.
_BACKOFF = 0.5


class _WriteFailed(Exception):
    """Writing to the destination failed (not the source): carries the ``OSError``."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _lower_priority() -> None:
    """Make the calling thread the lowest CPU priority (Linux: niceness is per thread).

    Uploads must never take CPU from the training thread; where this is not allowed
    (another OS) the thread keeps its priority.
    """
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def copy_files(
    src: Storage,
    dst: Storage,
    step: int,
    manifest: Manifest,
    *,
    replace: bool = False,
    threads: int = DEFAULT_THREADS,
    read_back: bool | None = False,
    gate: UploadGate | None = None,
    only: Collection[str] | None = None,
    into: Pending | None = None,
    lowest: bool = False,
) -> None:
    """Copy committed ``step`` from ``src`` to ``dst`` with ``dst``'s commit protocol.

    Every file is streamed from ``src`` with its size and CRC32C checked against
    ``manifest`` (a bad source byte aborts the copy, nothing of it becomes visible), written
    into a pending step of ``dst`` that checksums what it writes, and read again from
    ``dst`` once published: always with ``read_back=True``; with ``None``, only where the
    store did not check the bytes it received itself (S3: every request carries the MD5 of
    the checksummed bytes, see :mod:`ckptstore.storage.s3upload`); never with ``False``.
    The manifest is committed only after all that.

    ``gate`` (the uploader's :class:`~ckptstore.tiers.uploadgate.UploadGate`) is waited at before
    each slice read from ``src``, and by the bodies of S3 requests before each slice sent.

    ``only`` copies those files of ``manifest`` alone, and ``into`` writes them into a pending
    step the caller opened and commits (one rank's part of a per-rank upload): then nothing
    is committed, nor aborted on failure.

    The files are copied at the caller's priority, or with ``lowest`` (an upload: it must
    never take CPU from the training thread) on threads at the lowest priority, even a lone
    file; the caller's own thread keeps its priority either way.

    Raises:
        IntegrityError: a file does not match ``manifest`` (in ``src``, or read back).
        StepExistsError: ``step`` is committed in ``dst`` (and ``replace`` is not set).
        OSError: reading or writing failed; nothing of the step is visible in ``dst``.
    """
    pending = dst.begin(step, replace=replace) if into is None else into
    try:

        def one(name: str, entry: FileEntry) -> None:
            if gate is not None:  # no new file is opened, nor its first reads issued, in a save
                gate.wait()
            with pending.open(
                name, codec=entry.codec, compression=entry.compression, rank=entry.rank
            ) as w:
                expect = getattr(w, "expect", None)
                if expect is not None:  # an S3 upload: its size, and the gate of its requests
                    expect(entry.bytes, gate=gate)

                def pace() -> None:
                    # A stopped uploader's ReplicaError (an OSError) must not read as a bad
                    # source file: carried past stream_file like a failed write.
                    if gate is not None:
                        try:
                            gate.wait()
                        except ReplicaError as e:
                            raise _WriteFailed(e) from e

                def consume(offset: int, chunk: memoryview) -> None:
                    pace()
                    try:
                        w.write(chunk)
                    except OSError as e:
                        # stream_file takes an OSError for a bad source file: carry it past.
                        raise _WriteFailed(e) from e

                try:
                    src.stream_file(step, name, entry, consume, pace=pace)
                except _WriteFailed as e:
                    raise e.error from None
            # The store checked what it received (its CRC32C, or the MD5 where it checks no
            # CRC32C: see s3upload) against the very bytes whose CRC32C is compared with the
            # manifest just below: checked end to end, no read-back needed.
            checked_by_store = bool(getattr(w, "verified", False))
            got = pending.files[name]
            if (got.bytes, got.crc32c) != (entry.bytes, entry.crc32c):
                raise IntegrityError(
                    f"{dst.describe(step, name)}: {got.bytes} bytes with crc32c "
                    f"{got.crc32c:08x} were written, the manifest says {entry.bytes} bytes, "
                    f"crc32c {entry.crc32c:08x}"
                )
            if read_back or (read_back is None and not checked_by_store):
                if gate is not None:
                    gate.wait()
                size, crc = dst._stream(f"{pending.dirname}/{name}", None)
                if (size, crc) != (entry.bytes, entry.crc32c):
                    raise IntegrityError(
                        f"{dst.describe(step, name)}: read back {size} bytes with crc32c "
                        f"{crc:08x}, the manifest says {entry.bytes} bytes, crc32c "
                        f"{entry.crc32c:08x}; the copy is corrupt"
                    )

        chosen = (kv for kv in manifest.files.items() if only is None or kv[0] in only)
        items = sorted(chosen, key=lambda kv: -kv[1].bytes)
        # A copied file is written as fast as its source is read (the network, a gate): its
        # speed says nothing of the local write modes, and the files are written side by
        # side. So no trial and no measurement: the settled mode (iomode.side_by_side).
        with iomode.side_by_side(measure=False):
            if not lowest and (threads <= 1 or len(items) <= 1):
                for name, entry in items:  # on the caller's thread, at its priority
                    one(name, entry)
            elif items:
                # Threads of its own, never the caller's: lowering a thread's priority is for
                # good (per thread on Linux), and the caller's (a training thread) must keep
                # its own.
                errors = _on_threads(one, items, threads, lowest)
                first = next((e for e in errors if e is not None), None)
                if first is not None:
                    raise first
        if into is None:
            dst.commit(pending, manifest)
    except BaseException as e:
        if into is None:
            if gate is not None and gate.stopped and not isinstance(dst, LocalStorage):
                # The uploader stops (close() without waiting, a Ctrl-C, the process
                # exiting): removing what was sent would wait on the store; nothing of it is
                # visible (no manifest), and the next upload of the step replaces it.
                log.info("upload of step %d stopped; what was sent stays", pending.step)
            elif is_unreachable(e) and not isinstance(dst, LocalStorage):
                # Removing what was sent would wait on the endpoint that stopped answering
                # (30 s and more at the client's timeouts); the next uploader's recover()
                # removes it, and nothing of it is visible meanwhile (no manifest).
                log.warning(
                    "%s did not answer; what was sent of step %d stays until the next "
                    "upload cleans it",
                    dst.root,
                    pending.step,
                )
            else:
                dst.abort(pending)
        raise


def _on_threads(
    one: Callable[[str, FileEntry], None],
    items: list[tuple[str, FileEntry]],
    threads: int,
    lowest: bool,
) -> list[BaseException | None]:
    """Run ``one`` on each of ``items`` on up to ``threads`` daemon threads; their errors.

    Daemon threads, not a ``concurrent.futures`` pool: the interpreter's exit joins every
    pool's workers (its own exit hook), so a process that ended without ``close()`` waited
    there for the uploads in flight (94 s on an endpoint that stopped answering), only to
    drop them anyway (found by review). An upload abandoned so is invisible on the replica
    (no manifest) and is done again by the next uploader. Each thread runs in the caller's
    context: its write group (iomode) holds for the files.
    """
    todo = [(i, name, entry, contextvars.copy_context()) for i, (name, entry) in enumerate(items)]
    todo.reverse()  # popped from the end: the largest file first
    errors: list[BaseException | None] = [None] * len(items)
    lock = threading.Lock()

    def work() -> None:
        if lowest:
            _lower_priority()
        while True:
            with lock:
                if not todo:
                    return
                i, name, entry, ctx = todo.pop()
            try:
                ctx.run(one, name, entry)
            except BaseException as e:  # handed to the caller's thread
                errors[i] = e

    workers = [
        threading.Thread(target=work, name=f"ckptstore-copy_{k}", daemon=True)
        for k in range(max(1, min(threads, len(items))))
    ]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return errors


def fetch_step(
    replica: Storage,
    local: Storage,
    step: int,
    *,
    replace: bool = False,
    threads: int = DEFAULT_THREADS,
) -> Manifest:
    """Copy committed ``step`` from the replica into the local store (a cache for restore).

    The local copy is committed with the local protocol (tmp directory, fsync, rename) and
    marked ``replicated``; with ``replace`` it replaces a local ``step`` that does not
    verify, which stays until the copy commits.

    Raises:
        NoCheckpointError, ManifestError: the replica has no readable ``step``.
        IntegrityError: the replica's copy does not match its manifest.
        OSError: the local disk refused it (full, read-only); nothing is visible locally.
    """
    manifest = replica.read_manifest(step)
    copy_files(replica, local, step, manifest, replace=replace, threads=threads)
    mark_replicated(local, step, replica, manifest)
    log.info("fetched step %d from the replica %s", step, replica.root)
    return manifest
