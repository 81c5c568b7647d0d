"""POSIX filesystem backend: tmp directory, fsync, atomic rename, fsync of the parent."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import json
import mmap
import os
import shutil
import stat
import sys
from collections.abc import Iterator
from typing import IO, Any, ClassVar

import filelock

from .._log import logger as log
from ..errors import CommitError, ManifestError, StoreLockedError
from ..integrity import crc32c_of, format_crc
from ..layout import INDEX_NAME, LOCK_NAME, MANIFEST_NAME, index_tmp_name, step_dirname
from ..manifest import Manifest
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
        # Plain concatenation: os.path.join costs more than the lstat it feeds, and a
        # listing of 10,000 steps makes 40,000 of them. ``rel`` is always relative.
        return f"{self.root}/{rel}" if rel else self.root

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

    def _exchange(self, a: str, b: str) -> None:
        # renameat2(RENAME_EXCHANGE): both names stay taken throughout, so replacing a
        # committed step has no moment without a step-N (ext4, xfs, btrfs, tmpfs; not NFS).
        fn = _renameat2()
        if fn is None:
            raise NotImplementedError("renameat2 is not available")
        pa, pb = os.fsencode(self._p(a)), os.fsencode(self._p(b))
        if fn(_AT_FDCWD, pa, _AT_FDCWD, pb, _RENAME_EXCHANGE) != 0:
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise NotImplementedError(f"RENAME_EXCHANGE refused: {os.strerror(err)}")
            raise OSError(err, os.strerror(err), self._p(a))

    def _fsync_dir(self, rel: str) -> None:
        fd = os.open(self._p(rel), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # ---- listing cache -------------------------------------------------------------
    #
    # `ls` and retention planning on a store of 10,000 checkpoints would parse and validate
    # 10,000 manifests (about 0.15 ms each). A committed manifest never changes, so
    # `.ckptstore.index` remembers each validated manifest under the identity of its file
    # (device, inode, size, mtime_ns, ctime_ns): a listing then costs one lstat per step, and
    # only manifests whose file is new or changed are read again. The cache is advisory: a
    # torn, corrupt, foreign or unwritable index is ignored; it is never fsynced and never
    # consulted by restore or verify.

    def read_manifests(
        self, steps: list[int], *, complete: bool = False
    ) -> dict[int, Manifest | ManifestError]:
        """See :meth:`Storage.read_manifests`; served from the listing cache where valid."""
        with _gc_paused():  # tens of thousands of acyclic objects: the cyclic GC tripled the time
            return self._read_manifests(steps, complete)

    def _read_manifests(
        self, steps: list[int], complete: bool
    ) -> dict[int, Manifest | ManifestError]:
        cache = self._load_index()
        out: dict[int, Manifest | ManifestError] = {}
        fresh: dict[int, list[Any]] = {}
        misses = 0
        for s in steps:
            rel = f"{step_dirname(s)}/{MANIFEST_NAME}"
            before = _identity(self._p(rel))
            hit = cache.get(s)
            if before is not None and hit is not None and hit[0] == before:
                try:
                    m = Manifest.from_cache(hit[1])
                except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                    m = None
                if m is not None and m.step == s:
                    out[s] = m
                    fresh[s] = hit
                    continue
            misses += 1
            try:
                m = self.read_manifest(s)
            except ManifestError as e:
                out[s] = e
                continue
            out[s] = m
            if before is not None and _identity(self._p(rel)) == before:
                fresh[s] = [before, m.to_cache()]
        if complete and (misses or len(fresh) != len(cache)):
            self._save_index(fresh)
        return out

    def _load_index(self) -> dict[int, list[Any]]:
        path = self._p(INDEX_NAME)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return {}
        try:
            with open(fd, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_INDEX_BYTES:
                    return {}
                data = f.read(_MAX_INDEX_BYTES + 1)
            head, _, body = data.partition(b"\n")
            if head != b"ckptstore-index 1 " + format_crc(crc32c_of(body)).encode():
                raise ValueError("bad header or checksum")
            doc = json.loads(body)
            return {int(k): v for k, v in doc.items() if isinstance(v, list) and len(v) == 2}
        except (OSError, ValueError, TypeError, AttributeError, RecursionError) as e:
            log.debug("ignoring the listing cache %s: %s", path, e)
            return {}

    def _save_index(self, entries: dict[int, list[Any]]) -> None:
        body = json.dumps({str(k): v for k, v in entries.items()}, separators=(",", ":"))
        data = b"ckptstore-index 1 " + format_crc(crc32c_of(body.encode())).encode()
        data += b"\n" + body.encode()
        tmp = self._p(index_tmp_name())
        try:
            with open(tmp, "xb") as f:
                f.write(data)
            os.replace(tmp, self._p(INDEX_NAME))
        except (OSError, ValueError) as e:  # read-only store, full disk: a cache, not data
            log.debug("could not write the listing cache of %s: %s", self.root, e)
            with contextlib.suppress(OSError):
                os.unlink(tmp)

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


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h


def _renameat2() -> Any:
    """The C library's ``renameat2`` (glibc 2.28+), or ``None`` (not Linux, old glibc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


#: A listing cache larger than this is ignored (about 600 bytes per checkpoint).
_MAX_INDEX_BYTES = 1 << 30


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (objects are still freed by reference count)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _identity(path: str) -> list[int] | None:
    """What changes whenever a file is replaced or rewritten (ctime cannot be set)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


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
