"""POSIX filesystem backend: tmp directory, fsync, atomic rename, fsync of the parent."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import shutil
import stat
import time
import weakref
from collections.abc import Callable, Mapping
from typing import IO, Any, ClassVar

from .._gc import gc_paused
from .._libc import libc_function
from .._log import logger as log
from ..errors import CommitError, ConfigError, ManifestError, StoreLockedError
from ..integrity import crc32c_of, format_crc
from ..layout import INDEX_NAME, LOCK_NAME, MANIFEST_NAME, index_tmp_name, step_dirname
from ..manifest import FileEntry, Manifest
from . import iomode
from .base import Storage
from .blockgate import Consumer
from .directio import (
    DirectWriter,
    open_direct_read,
    open_nonblocking,
    read_into,
    stream_pipelined,
)
from .iomode import IO_MODES
from .ranges import RangeReader

__all__ = ["LocalStorage"]


#: The errors of ``lstat`` that mean "there is no such entry".
_ABSENT = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG})


class LocalStorage(Storage):
    """A store in a local (or POSIX network) directory."""

    atomic_rename: ClassVar[bool] = True
    lockable: ClassVar[bool] = True
    cheap_listing: ClassVar[bool] = True

    def __init__(self, root: str, *, direct_io: bool = True, io: str = "auto") -> None:
        """A store at ``root``.

        Args:
            root: the store's directory (created at the first save).
            direct_io: ``False`` never uses ``O_DIRECT`` (as ``io="buffered"``).
            io: how payloads are read and written: ``"auto"`` (each device's faster mode,
                measured once per process: see ``storage/iomode.py``), ``"direct"``
                (``O_DIRECT`` where the filesystem allows it) or ``"buffered"``.

        Raises:
            ValueError: an unknown ``io``.
        """
        super().__init__(os.path.abspath(os.path.expanduser(root)))
        if io not in IO_MODES:
            msg = f"io must be one of {', '.join(IO_MODES)}, got {io!r}"
            raise ConfigError(msg)
        #: Use O_DIRECT for payload files where the filesystem allows it (and io allows).
        self.direct_io = direct_io
        self.io = io

    def _p(self, rel: str) -> str:
        # Plain concatenation: os.path.join costs more than the lstat it feeds, and a
        # listing of 10,000 steps makes 40,000 of them. ``rel`` is always relative.
        return f"{self.root}/{rel}" if rel else self.root

    def _list(self, rel: str) -> list[str]:
        try:
            return os.listdir(self._p(rel))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _lstat(self, rel: str) -> os.stat_result | None:
        """``lstat`` of ``rel``; None only where it is absent (or could not be: a name too long).

        Any other error (EIO, ESTALE, EACCES: a disk or a network filesystem failing for a
        moment) is raised, never taken for "absent": a committed step whose manifest
        could not be looked at was counted as manifest-less garbage, which ``gc`` (and a
        job's first save) removed (``os.path.lexists`` answers False on every error).
        """
        try:
            return os.lstat(self._p(rel))
        except OSError as e:
            if e.errno in _ABSENT:
                return None
            raise

    def _exists(self, rel: str) -> bool:
        return self._lstat(rel) is not None

    def _root_kind(self) -> str:
        # The root itself may be reached through a symlink (to a directory): stat follows.
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            return "missing"
        except NotADirectoryError:
            return "blocked"  # a file where a parent directory should be
        return "dir" if stat.S_ISDIR(st.st_mode) else "file"

    def _is_regular_file(self, rel: str) -> bool:
        st = self._lstat(rel)
        return st is not None and stat.S_ISREG(st.st_mode)

    def _size(self, rel: str) -> int:
        return os.lstat(self._p(rel)).st_size

    def _is_plain_dir(self, rel: str) -> bool:
        st = self._lstat(rel)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def _mkdir(self, rel: str) -> None:
        _makedirs_durable(self.root)
        os.mkdir(self._p(rel))

    def _open_write(self, rel: str) -> IO[bytes]:
        # Payloads bypass the page cache (O_DIRECT where the filesystem allows it): they
        # are written once, fsynced, and not read back soon. See directio.py.
        direct = self.direct_io and self.io != "buffered"
        if not (direct and self.io == "auto"):
            return DirectWriter(self._p(rel), direct=direct)  # type: ignore[return-value]
        # Chosen when a file fills a whole buffer (small files never ask), from the speeds
        # earlier large saves to this device reached in each mode (iomode.py).
        where = self._p(rel.rpartition("/")[0])

        def choose() -> bool:
            return iomode.write_mode(where) == "direct"

        def report(was_direct: bool, nbytes: int, seconds: float) -> None:
            mode = "direct" if was_direct else "buffered"
            iomode.record_write(where, mode, nbytes, seconds)

        w = DirectWriter(self._p(rel), direct=True, choose=choose, report=report)
        return w  # type: ignore[return-value]

    def _finish_write(self, f: IO[bytes], rel: str) -> None:
        if isinstance(f, DirectWriter):
            f.finish()
            return
        f.flush()
        os.fsync(f.fileno())
        f.close()

    def _put_small(self, rel: str, data: bytes) -> None:
        # Manifests: one buffered write and an fsync, cheaper than aligned I/O.
        self._create(rel, data, fsync=True)

    def _put_marker(self, rel: str, data: bytes) -> None:
        # The pin marker: is_pinned only looks for its name, so an fsync of its bytes would
        # buy nothing; the caller fsyncs the directory, which makes the name durable.
        self._create(rel, data, fsync=False)

    def _create(self, rel: str, data: bytes, *, fsync: bool) -> None:
        # The directory is opened without following a symlink, as readers open it: a step
        # directory swapped for a link must not make us create a file outside the root.
        dfd = _open_dir(self._p, rel)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(rel.rpartition("/")[2], flags, 0o644, dir_fd=dfd)
        finally:
            os.close(dfd)
        try:
            view = memoryview(data)
            done = 0
            while done < len(view):
                n = os.pwrite(fd, view[done:], done)
                if n <= 0:
                    raise OSError(errno.EIO, f"short write to {self._p(rel)}")
                done += n
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _open_read(self, rel: str) -> IO[bytes]:
        # Open every component without following symlinks: a manifest or a swapped-in link
        # must never make us read outside the root.
        head, _, name = rel.rpartition("/")
        dfd = os.open(self._p(head), os.O_RDONLY | os.O_DIRECTORY | (os.O_NOFOLLOW if head else 0))
        try:
            fd = open_nonblocking(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
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

    def _stream(
        self,
        rel: str,
        consume: Consumer | None,
        *,
        crc: bool = True,
        pace: Callable[[], None] | None = None,
    ) -> tuple[int, int]:
        # Large files: several reads in flight on I/O threads into aligned buffers while the
        # slice before them is checksummed and consumed, so the disk never waits for the
        # CPU; O_DIRECT or buffered (with sequential readahead), whichever the device was
        # measured to read faster (iomode.py). Small files (state.json): one buffered read.
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
                if pace is not None:
                    pace()
                return _stream_small(fd, st.st_size, consume)
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger readahead
            mode = "buffered" if not self.direct_io else self.io
            if mode == "auto":
                mode = iomode.read_mode(st.st_dev)
            t0 = time.perf_counter()
            got = None
            if mode == "direct":
                dfd2 = self._open_direct_twin(head, name, st)
                if dfd2 is not None:
                    try:
                        got = stream_pipelined(dfd2, consume, crc=crc, pace=pace)
                    finally:
                        os.close(dfd2)
                else:
                    mode = "buffered"  # O_DIRECT refused (tmpfs)
            if got is None:
                got = stream_pipelined(fd, consume, crc=crc, pace=pace)
            # A paced read (a background upload) waited at its gate and on the network: its
            # time says nothing of the disk, and one such figure would steer every restore
            # of this process (and, through the cache, of later ones) to the other mode.
            if self.io == "auto" and self.direct_io and pace is None:
                iomode.record_read(st.st_dev, mode, got[0], time.perf_counter() - t0)
            return got
        finally:
            os.close(fd)

    def _open_direct_twin(self, head: str, name: str, st: os.stat_result) -> int | None:
        """A second descriptor of the same file with ``O_DIRECT``; None where refused.

        A separate open (O_DIRECT is a flag of the open file, shared by dup'd descriptors),
        by the same no-symlink path, checked to be the same inode.
        """
        dfd = os.open(self._p(head), os.O_RDONLY | os.O_DIRECTORY | (os.O_NOFOLLOW if head else 0))
        try:
            fd, direct = open_direct_read(name, dir_fd=dfd, direct=True)
        finally:
            os.close(dfd)
        st2 = os.fstat(fd)
        if not direct or (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
            os.close(fd)
            return None
        return fd

    def range_reader(self, step: int, files: Mapping[str, FileEntry]) -> RangeReader:
        """A reader of byte ranges of ``step``'s files (see :class:`_LocalRanges`)."""
        return _LocalRanges(self, step, files)

    def _remove(self, rel: str) -> None:
        dfd = _open_dir(self._p, rel)  # never through a symlinked directory
        try:
            os.unlink(rel.rpartition("/")[2], dir_fd=dfd)
        finally:
            os.close(dfd)

    def entry_age(self, name: str) -> float | None:
        """Seconds since the newest mtime under the root entry ``name`` (links not followed)."""
        try:
            top = os.lstat(self._p(name))
        except OSError:
            return None
        newest = top.st_mtime
        if not stat.S_ISDIR(top.st_mode):  # a link (never followed) or a file: itself
            return max(0.0, time.time() - newest)
        for base, dirs, files in os.walk(self._p(name)):  # below: links not followed
            for n in dirs + files:
                with contextlib.suppress(OSError):
                    newest = max(newest, os.lstat(os.path.join(base, n)).st_mtime)
        return max(0.0, time.time() - newest)

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

    def _link(self, src: str, dst: str) -> None:
        # A hard link: committed files are never written again, so two names for one
        # inode are two names for the same bytes. A filesystem without links copies.
        try:
            os.link(self._p(src), self._p(dst))
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            self._copy(src, dst)

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
        _fsync_directory(self._p(rel))

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
        with gc_paused():  # tens of thousands of acyclic objects: the cyclic GC tripled the time
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
            fd = open_nonblocking(path, os.O_RDONLY | os.O_NOFOLLOW)
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
            # A cache is no change of the store: the root keeps its modification time.
            # Lightning resumes ckpt_path="last" from the newest last*.ckpt by that time,
            # and `ckptstore ls` over a run's stores made last.ckpt (an older run's) the
            # newest of them all.
            before = os.stat(self.root)
            with open(tmp, "xb") as f:
                f.write(data)
            os.replace(tmp, self._p(INDEX_NAME))
            with contextlib.suppress(OSError):
                os.utime(self.root, ns=(before.st_atime_ns, before.st_mtime_ns))
        except (OSError, ValueError) as e:  # read-only store, full disk: a cache, not data
            log.debug("could not write the listing cache of %s: %s", self.root, e)
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def writer_lock(self) -> _WriterLock:
        """The store's writer lock (``.ckptstore.lock``), acquired without waiting."""
        return _WriterLock(self._p(LOCK_NAME), self.root)


class _LocalRanges(RangeReader):
    """:class:`RangeReader` of a local store, with ``O_DIRECT`` for a restore's runs.

    Ranges go through a buffered ``pread``; a restore's runs of a file
    (``sharded/extents.py``) through an ``O_DIRECT`` twin of it where the store's ``io``
    says so or, with ``"auto"``, where the device read faster that way (``iomode``, the
    same table the streamed reads keep).
    """

    storage: LocalStorage

    def __init__(self, storage: LocalStorage, step: int, files: Mapping[str, FileEntry]) -> None:
        super().__init__(storage, step, files)
        self._direct: dict[str, int | None] = {}
        self._dev: int | None = None

    def _device(self) -> int:
        if self._dev is None:
            self._dev = os.stat(self.storage._p(step_dirname(self.step))).st_dev
        return self._dev

    def read_mode(self) -> str | None:
        store = self.storage
        if not store.direct_io or store.io == "buffered":
            return "buffered"
        if store.io == "direct":
            return "direct"
        try:
            dev = self._device()
        except OSError:  # the step is gone (retention): its reads say so, as IntegrityError
            return "buffered"
        return iomode.read_mode(dev)

    def direct_fd(self, name: str) -> int | None:
        with self._lock:
            if name in self._direct:
                return self._direct[name]
            f = self._file(name)  # the size checked against the manifest
            try:
                fd = self.storage._open_direct_twin(
                    step_dirname(self.step), name, os.fstat(f.fileno())
                )
            except OSError:
                fd = None  # read through the buffered descriptor instead
            self._direct[name] = fd
            return fd

    def record_read(self, mode: str, nbytes: int, seconds: float) -> None:
        if self.storage.io == "auto" and self.storage.direct_io and self._dev is not None:
            iomode.record_read(self._dev, mode, nbytes, seconds)

    def close(self) -> None:
        with self._lock:
            for fd in self._direct.values():
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._direct.clear()
        super().close()


class _WriterLock(contextlib.AbstractContextManager[Any]):
    """The store's writer lock: ``flock(2)`` on ``.ckptstore.lock``, taken without waiting.

    Written here on ``fcntl`` rather than with filelock: the 3.x releases open the path with
    ``O_TRUNC`` and follow a symlink there, so a link planted at ``.ckptstore.lock`` made
    every writer empty the file it points to (and ``is_singleton=False``, which a lock that
    refuses a second writer in the same process needs, only exists since 3.13, so
    ``filelock>=3.12`` installed one that raised TypeError). This lock file is opened with
    ``O_NOFOLLOW`` and without ``O_TRUNC`` (its content is never read or written), and must
    be a regular file. ``flock`` locks the open file description, so a second lock object
    is refused in this process as in any other, and the kernel drops the lock when its
    holder dies.

    A maintenance command (``prune``, ``gc``, ``rm``: :meth:`acquire_maintenance`) also
    holds a ``flock`` on the store's root directory while it holds the writer lock, taken
    before it and given back after it: its marker, which creates no file (a refused command
    leaves the store as it was) and no link can redirect. A job's first save that finds the
    writer lock taken looks at it (:meth:`acquire`'s ``maintenance_wait``): a command at
    work is waited for, up to that bound, and another job is refused at once as before. A
    job started while a cron ``prune`` ran failed its first save with ``StoreLockedError``.
    Where directories cannot be locked (NFS), no command is known and none is waited for.
    Any other process's exclusive ``flock`` on the root (a ``flock DIR cmd`` wrapper) is
    taken for a command too: a second job then waits the bound before it is refused.
    """

    def __init__(self, path: str, root: str) -> None:
        self.path = path
        self.root = root
        self._fd: int | None = None
        # The held descriptors (the writer lock's, a maintenance command's marker), shared
        # with the finalizer (which must not hold self): a manager dropped without close()
        # kept the lock until the process exited, and the next manager of the same process
        # was told to stop "the other job" (found by review). A forked child empties them
        # (_forget_in_child).
        self._box: list[int | None] = [None, None]
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def is_locked(self) -> bool:
        return self._fd is not None

    def acquire(self, timeout: float = 0, *, maintenance_wait: float = 0.0) -> None:
        """Take the lock, waiting at most ``timeout`` seconds for another writer.

        With ``maintenance_wait``, a lock held by a maintenance command (its marker held
        too) is waited for up to that many seconds more; one held by anything else is
        refused once ``timeout`` has passed.

        Raises:
            StoreLockedError: another writer holds it.
            CommitError: the lock file cannot be opened (no write access, the root is not a
                directory, a symlink or anything but a regular file at the lock's path).
        """
        if self._fd is not None:
            return
        fd = self._open()
        try:
            self._take(fd, timeout, maintenance_wait)
        except BaseException:
            os.close(fd)
            raise
        self._held(fd)

    def acquire_maintenance(self) -> None:
        """Take the lock for a maintenance command, its marker first (see the class).

        Raises:
            StoreLockedError: a job or another command holds the writer lock.
            CommitError: as :meth:`acquire`.
        """
        if self._fd is not None:
            return
        marker = self._take_marker()
        try:
            self.acquire()
        except BaseException:
            if marker is not None:
                _unlock(marker)
            raise
        self._box[1] = marker

    def _take(self, fd: int, timeout: float, maintenance_wait: float) -> None:
        deadline = time.monotonic() + max(0.0, timeout)
        until: float | None = None  # the end of the wait for a maintenance command
        looked_again = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    msg = (
                        f"cannot write to the store {self.root}: locking {self.path} failed "
                        f"({e.strerror or e}); the filesystem must support flock(2)"
                    )
                    raise CommitError(msg) from e
            now = time.monotonic()
            if now < deadline:
                time.sleep(0.05)
                continue
            if maintenance_wait <= 0:
                break
            if self._maintenance_at_work():
                if until is None:
                    until = now + maintenance_wait
                    log.warning(
                        "%s: a maintenance command (`ckptstore prune`, `gc`, `rm`) holds the "
                        "writer lock (or another process flocks the directory); waiting up "
                        "to %gs for it to end",
                        self.root,
                        maintenance_wait,
                    )
                if now < until:
                    time.sleep(0.1)
                    continue
                msg = (
                    f"{self.root} is locked by a maintenance command (`ckptstore prune`, "
                    f"`gc`, `rm`) that held it for over {maintenance_wait:g}s "
                    f"({self.path}); nothing was written. Let it finish (or stop it), then "
                    "start again. (Another process holding a flock on the directory itself, "
                    "such as a `flock DIR` wrapper, looks like such a command)"
                )
                raise StoreLockedError(msg)
            if looked_again:
                break
            # The command gives back its writer lock before its marker: one that just ended
            # left the writer lock free by now.
            looked_again = True
        msg = (
            f"{self.root} is locked by another writer ({self.path}): another job "
            "writing it, or a maintenance command at work (`ckptstore prune`, "
            "`gc`, `rm`); two jobs must not write one store. Stop the other job "
            "or give this one its own directory, or retry once the command ended"
        )
        raise StoreLockedError(msg)

    def _open_root(self) -> int | None:
        """The root directory, opened for its ``flock`` (None: it cannot be)."""
        try:
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            log.debug("cannot open %s for its maintenance marker: %s", self.root, e)
            return None

    def _take_marker(self) -> int | None:
        """A maintenance command's marker, held; None where it cannot be had.

        Without it no waiting job knows the command, which goes on as before the marker.
        """
        fd = self._open_root()
        if fd is None:
            return None
        # A job looking whether a command is at work holds it shared for an instant.
        deadline = time.monotonic() + 2.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    os.close(fd)  # a filesystem without flock on directories
                    return None
                if time.monotonic() >= deadline:
                    os.close(fd)  # another command holds it: the writer lock says so
                    return None
                time.sleep(0.01)

    def _maintenance_at_work(self) -> bool:
        """Whether a maintenance command holds its marker now (see the class)."""
        fd = self._open_root()
        if fd is None:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
        finally:
            os.close(fd)  # closing the only descriptor of the description unlocks it
        return False

    def _held(self, fd: int) -> None:
        self._fd = fd
        self._box[0] = fd
        self._finalizer = weakref.finalize(self, _unlock_box, self._box)
        _HELD.add(self)

    def _open(self) -> int:
        try:
            _makedirs_durable(self.root)
            # O_NONBLOCK: a FIFO planted at the path must not block the open.
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            fd = os.open(self.path, flags, 0o644)
        except (FileExistsError, NotADirectoryError):
            msg = (
                f"{self.root} is not a directory, so it cannot be a checkpoint store; give "
                "the path of a directory (it is created if missing)"
            )
            raise CommitError(msg) from None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EISDIR):
                raise self._not_a_file() from None
            msg = (
                f"cannot write to the store {self.root}: taking its writer lock {self.path} "
                f"failed ({e.strerror or e}); a writer needs write access to the directory"
            )
            raise CommitError(msg) from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise self._not_a_file()
        return fd

    def _not_a_file(self) -> CommitError:
        return CommitError(
            f"cannot write to the store {self.root}: its writer lock {self.path} is a symlink "
            "or not a regular file, and ckptstore never follows or opens anything else there "
            "(a link could make it lock or damage another file). Remove it; the next writer "
            "creates a plain lock file"
        )

    def release(self) -> None:
        """Give the lock back (a no-op when not held); a command's marker after it."""
        self._fd = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        _HELD.discard(self)
        _unlock_box(self._box)

    def _forget_in_child(self) -> None:
        """In a forked child: close this process's copy of the descriptors, never unlocking.

        ``flock`` locks the open file description the child shares: its unlock (a ``with``
        block left, ``close()``) released the parent's lock and let a second job write the
        store, and a child outliving its parent kept the lock from the next job (found by
        review). The parent alone holds it; the child may take it only after the parent.
        """
        fds = [fd for fd in self._box if fd is not None]
        self._box[:] = [None, None]
        self._fd = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> _WriterLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


#: The writer locks this process holds (see :meth:`_WriterLock._forget_in_child`).
_HELD: weakref.WeakSet[_WriterLock] = weakref.WeakSet()


def _unlock_box(box: list[int | None]) -> None:
    """Unlock and close the descriptors in ``box`` (emptied first), in order.

    Each one even where an earlier one failed; the first failure is raised after.
    """
    fds = list(box)
    box[:] = [None] * len(box)
    failed: OSError | None = None
    for fd in fds:
        if fd is not None:
            try:
                _unlock(fd)
            except OSError as e:
                failed = failed or e
    if failed is not None:
        raise failed


def _unlock(fd: int) -> None:
    try:
        # Unlock before closing: a child forked before the fork hook existed shares the
        # open file description, and a close alone would leave the lock held.
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _forget_locks_in_child() -> None:
    for lock in list(_HELD):
        lock._forget_in_child()
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks_in_child)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h


def _renameat2() -> Any:
    """The C library's ``renameat2`` (glibc 2.28+), or ``None`` (not Linux, old glibc)."""
    return libc_function(
        "renameat2", (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    )


#: A listing cache larger than this is ignored (about 600 bytes per checkpoint).
_MAX_INDEX_BYTES = 1 << 30


def _identity(path: str) -> list[int] | None:
    """What changes whenever a file is replaced or rewritten (ctime cannot be set)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _open_dir(path_of: Callable[[str], str], rel: str) -> int:
    """An fd of the directory holding ``rel``; a symlink there is refused (ELOOP), not followed.

    Only the last component is checked: the root itself may be reached through a symlink.
    """
    head = rel.rpartition("/")[0]
    nofollow = os.O_NOFOLLOW if head else 0
    return os.open(path_of(head), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | nofollow)


def _fsync_directory(path: str) -> None:
    """Make the entries of a directory durable (rename(2), fsync(2))."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs_durable(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)`` whose new directories survive a power cut.

    A directory made by mkdir(2) is durable only once its parent is fsynced: without that,
    a new store whose first checkpoint was committed (the root fsynced) could come back
    from a power cut without the root, or without the parents created for it.

    Raises:
        FileExistsError: a file is where a directory should be.
        OSError: a directory could not be made (permissions, read-only filesystem).
    """
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):  # a symlink to a directory is a directory here
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
            # Made meanwhile by another process: fsync its parent anyway, as we return
            # saying it exists.
        _fsync_directory(os.path.dirname(d))


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
