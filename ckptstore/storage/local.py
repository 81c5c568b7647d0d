"""POSIX filesystem backend: tmp directory, fsync, atomic rename, fsync of the parent."""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import stat
from typing import IO, Any, ClassVar

import filelock

from ..errors import CommitError, StoreLockedError
from ..integrity import crc32c_of
from ..layout import LOCK_NAME
from .base import Consumer, Storage
from .directio import BUFFER, Call, DirectWriter, open_direct_read, read_into, set_direct

__all__ = ["LocalStorage"]


class LocalStorage(Storage):
    """A store in a local (or POSIX network) directory."""

    atomic_rename: ClassVar[bool] = True
    lockable: ClassVar[bool] = True

    def __init__(self, root: str, *, direct_io: bool = True) -> None:
        super().__init__(os.path.abspath(os.path.expanduser(root)))
        #: Use O_DIRECT for payload files where the filesystem allows it.
        self.direct_io = direct_io

    def _p(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def _list(self, rel: str) -> list[str]:
        try:
            return os.listdir(self._p(rel))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _exists(self, rel: str) -> bool:
        return os.path.lexists(self._p(rel))

    def _is_regular_file(self, rel: str) -> bool:
        try:
            st = os.lstat(self._p(rel))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode)

    def _size(self, rel: str) -> int:
        return os.lstat(self._p(rel)).st_size

    def _mkdir(self, rel: str) -> None:
        os.makedirs(self.root, exist_ok=True)
        os.mkdir(self._p(rel))

    def _open_write(self, rel: str) -> IO[bytes]:
        # Payloads bypass the page cache (O_DIRECT where the filesystem allows it): they
        # are written once, fsynced, and not read back soon. See directio.py.
        return DirectWriter(self._p(rel), direct=self.direct_io)  # type: ignore[return-value]

    def _finish_write(self, f: IO[bytes], rel: str) -> None:
        if isinstance(f, DirectWriter):
            f.finish()
            return
        f.flush()
        os.fsync(f.fileno())
        f.close()

    def _put_small(self, rel: str, data: bytes) -> None:
        # Manifests, pins: one buffered write and an fsync, cheaper than aligned I/O.
        with open(self._p(rel), "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def _open_read(self, rel: str) -> IO[bytes]:
        # Open every component without following symlinks: a manifest or a swapped-in link
        # must never make us read outside the root.
        head, _, name = rel.rpartition("/")
        dfd = os.open(self._p(head), os.O_RDONLY | os.O_DIRECTORY | (os.O_NOFOLLOW if head else 0))
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
        finally:
            os.close(dfd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                msg = f"{self._p(rel)} is not a regular file"
                raise OSError(msg)
        except BaseException:
            os.close(fd)
            raise
        return open(fd, "rb", buffering=0)

    def _stream(self, rel: str, consume: Consumer | None) -> tuple[int, int]:
        # Large files: O_DIRECT reads into two aligned buffers, one filled by an I/O thread
        # while the other is checksummed and consumed, so the disk never waits for the CPU.
        # Small files (state.json, small payloads): one buffered read.
        head, _, name = rel.rpartition("/")
        dfd = os.open(self._p(head), os.O_RDONLY | os.O_DIRECTORY | (os.O_NOFOLLOW if head else 0))
        try:
            fd, _ = open_direct_read(name, dir_fd=dfd, direct=False)
        finally:
            os.close(dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                msg = f"{self._p(rel)} is not a regular file"
                raise OSError(msg)
            if st.st_size < SMALL_FILE:
                return _stream_small(fd, st.st_size, consume)
            if self.direct_io:
                set_direct(fd, True)  # refused (tmpfs): buffered reads, same code
            return _stream_large(fd, consume)
        finally:
            os.close(fd)

    def _remove(self, rel: str) -> None:
        os.unlink(self._p(rel))

    def _rmtree(self, rel: str) -> None:
        p = self._p(rel)
        st = os.lstat(p)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(p)  # fd-based on Linux: never follows symlinks inside
        else:
            os.unlink(p)  # a file or a symlink planted where a directory was: unlink only

    def _rename(self, src: str, dst: str) -> None:
        # rename(2) replaces an existing empty directory silently; callers check first,
        # under the writer lock.
        os.rename(self._p(src), self._p(dst))

    def _fsync_dir(self, rel: str) -> None:
        fd = os.open(self._p(rel), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def writer_lock(self) -> _WriterLock:
        """The store's writer lock (``.ckptstore.lock``), acquired without waiting."""
        return _WriterLock(self._p(LOCK_NAME), self.root)


class _WriterLock(contextlib.AbstractContextManager[Any]):
    """filelock's FileLock that fails at once with :class:`StoreLockedError`."""

    def __init__(self, path: str, root: str) -> None:
        self.path = path
        self.root = root
        self._lock = filelock.FileLock(path, timeout=0, thread_local=False, is_singleton=False)

    @property
    def is_locked(self) -> bool:
        return bool(self._lock.is_locked)

    def acquire(self, timeout: float = 0) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
            self._lock.acquire(timeout=timeout)
        except (FileExistsError, NotADirectoryError):
            msg = (
                f"{self.root} is not a directory, so it cannot be a checkpoint store; give "
                "the path of a directory (it is created if missing)"
            )
            raise CommitError(msg) from None
        except filelock.Timeout:
            msg = (
                f"{self.root} is locked by another writer ({self.path}); two jobs must not "
                "write one store. Stop the other job or give this one its own directory"
            )
            raise StoreLockedError(msg) from None
        except OSError as e:
            msg = (
                f"cannot write to the store {self.root}: taking its writer lock {self.path} "
                f"failed ({e.strerror or e}); a writer needs write access to the directory"
            )
            raise CommitError(msg) from e

    def release(self) -> None:
        if self._lock.is_locked:
            self._lock.release(force=True)

    def __enter__(self) -> _WriterLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


#: Files below this size are read in one buffered call.
SMALL_FILE = 1 << 20


def _stream_small(fd: int, size: int, consume: Consumer | None) -> tuple[int, int]:
    buf = bytearray(size + 1)  # one byte more: a file that grew is seen to have grown
    mv = memoryview(buf)
    n = read_into(fd, mv, 0)
    chunk = mv[:n]
    crc = crc32c_of(chunk)
    if consume is not None and n:
        consume(0, chunk)
    return n, crc


def _stream_large(fd: int, consume: Consumer | None) -> tuple[int, int]:
    bufs = [mmap.mmap(-1, BUFFER), mmap.mmap(-1, BUFFER)]
    views = [memoryview(b) for b in bufs]
    fut: Call | None = Call(read_into, fd, views[0], 0)
    try:
        crc = 0
        offset = 0
        cur = 0
        while fut is not None:
            n = fut.result()
            fut = None
            if n == 0:
                break
            if n == BUFFER:
                fut = Call(read_into, fd, views[cur ^ 1], offset + n)
            chunk = views[cur][:n]
            try:
                crc = crc32c_of(chunk, crc)
                if consume is not None:
                    consume(offset, chunk)
            finally:
                chunk.release()
            offset += n
            cur ^= 1
        return offset, crc
    finally:
        if fut is not None:  # never free a buffer the I/O thread is still reading into
            with contextlib.suppress(Exception):
                fut.result()
        for v in views:
            v.release()
        for b in bufs:
            # A view a failed consumer still holds (in its traceback) would turn the real
            # error into a BufferError; the mapping is then freed with the view.
            with contextlib.suppress(BufferError):
                b.close()
