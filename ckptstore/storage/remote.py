"""fsspec backend for object stores and other filesystems without an atomic rename.

Commits are manifest-last: payloads go straight into ``step-N/`` and ``manifest.json`` is
put last, in one request; readers look only at manifests, so the step is invisible until
that request completes. Deletion removes the manifest first.

Four things about fsspec filesystems shape this file:

- **Listings are cached.** s3fs (and gcsfs, adlfs) keep a ``dircache`` of directory listings
  per filesystem instance and answer ``exists``/``info``/``isfile``/``size``/``open`` from it.
  Another process's commit, deletion or overwrite never reaches that cache, so a process
  that once listed ``step-N/`` while its save was in flight would call the committed
  manifest missing forever, and read an overwritten object with its old size and ETag.
  Every query here first drops the cached listings of the path and its parents
  (:meth:`FsspecStorage._fresh`), so it asks the store itself.
- **One listing, not one request per step.** ``find`` without ``maxdepth`` is a single
  flat, paginated ``ListObjectsV2`` on S3 (never served from the cache); with ``maxdepth``
  it walks one ``ls`` per directory. :meth:`FsspecStorage._scan` lists the store once for
  both the committed steps and the garbage.
- **``rm`` globs.** ``fs.rm(path)`` expands ``*``, ``?`` and ``[`` in ``path`` as a glob, so
  a store at ``s3://b/exp[1]`` removing ``step-1`` would also remove ``s3://b/exp1/step-1``.
  :meth:`FsspecStorage._rmtree` never hands such a path to ``rm``.
- **One stream per object is slow.** A buffered fsspec file reads an object as one
  sequential stream with a large read-ahead (s3fs: 50 MB), so a ranged read of a few blocks
  fetches far more, and one large object is fetched at one connection's speed.
  :meth:`FsspecStorage._stream` reads objects as ranged GETs of 8-32 MiB, a few in flight
  per object (from a small shared pool), handed on in order;
  :meth:`FsspecStorage.range_reader` reads exactly the ranges asked for. The reader decodes
  up to :attr:`FsspecStorage.read_concurrency` files at once.
- **Closing a file publishes it.** An S3 upload is committed by ``close()``, a failed one
  must be discarded instead (which also aborts a multipart upload, billed until aborted):
  :class:`_Upload` gives the base class the ``abort`` it calls on failure. On s3fs, new
  objects are written by :class:`~ckptstore.storage.s3upload.S3Upload` instead of s3fs's
  buffered file (which sends one part at a time, waiting inside ``write``): one PUT below
  100 MiB, else 16 MiB parts several at once, every request checked by the server against
  the MD5 of its body, so a copy needs no read-back (``S3Upload.verified``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import io
import os
import posixpath
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any, ClassVar, TypeVar

from ..errors import IntegrityError, StoreUnreachableError
from ..integrity import crc32c_of
from ..layout import MANIFEST_NAME, PIN_NAME, step_dirname
from ..manifest import FileEntry, Manifest, validate_file_name
from .base import Storage
from .blockgate import Consumer
from .ranges import RangeReader
from .reach import reaching, remote_error
from .rootstate import split_root
from .s3upload import S3Upload, is_s3

__all__ = ["FsspecStorage"]

#: Characters fsspec's ``rm``/``expand_path`` treat as a glob (``glob.has_magic``).
_GLOB_CHARS = re.compile(r"[*?\[]")
#: Bytes one ranged GET of a streamed object asks for, at least and at most: an object is
#: cut into about 8 ranges within these bounds. Servers that answer a range by reading the
#: whole object (moto does) pay for every range, so a large object takes fewer, larger ones.
RANGE = 8 << 20
MAX_RANGE = 32 << 20
#: Bytes of ranged GETs in flight per streamed object (at least 2 ranges, at most 4).
IN_FLIGHT = 64 << 20
WINDOW = 4
#: Threads issuing ranged GETs, shared by every object this process reads.
GET_THREADS = 16


_F = TypeVar("_F", bound=Callable[..., Any])


def _reaching(method: _F) -> _F:
    """Raise the client's errors of talking to the store as one line that says what to check.

    No credentials, an endpoint that does not answer, access denied: one
    :class:`~ckptstore.errors.StoreUnreachableError` naming the store, the client's error
    as its cause, not 100+ lines of chained botocore/aiohttp tracebacks out of ``resume()``.
    """

    @functools.wraps(method)
    def wrapper(self: FsspecStorage, *args: Any, **kwargs: Any) -> Any:
        with reaching(self.root, StoreUnreachableError):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


@functools.cache
def _getters() -> concurrent.futures.ThreadPoolExecutor:
    """The GET workers: they only fetch, never wait on each other, so sharing them is safe."""
    return concurrent.futures.ThreadPoolExecutor(GET_THREADS, thread_name_prefix="ckptstore-get")


# A forked child has none of the parent's GET threads (see codec.zstd's pool): its own.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_getters.cache_clear)


class _RangeGets(RangeReader):
    """A :class:`RangeReader` whose every read is one ranged GET of exactly its bytes.

    A buffered fsspec file would read ahead far past a range (s3fs: 50 MB), which a
    partial load must not pay. Reads of several threads run at once.
    """

    storage: FsspecStorage

    def __init__(self, storage: FsspecStorage, step: int, files: Mapping[str, FileEntry]) -> None:
        super().__init__(storage, step, files)
        self._sized: set[str] = set()

    def check_size(self, name: str) -> None:
        """Check ``name``'s size against the manifest (one HEAD, once a file)."""
        where = self.storage.describe(self.step, name)
        entry = self.files.get(name)
        if entry is None:
            raise IntegrityError(f"{where}: not listed in the manifest")
        validate_file_name(name)
        if name not in self._sized:
            size = self.storage.file_size(self.step, name)
            if size != entry.bytes:
                raise IntegrityError(
                    f"{where}: file has {size} bytes, manifest says {entry.bytes}; "
                    "it is truncated, missing or replaced"
                )
            with self._lock:
                self._sized.add(name)

    def read(self, name: str, offset: int, length: int) -> bytearray:
        """``length`` bytes of ``name`` from ``offset``, in one request."""
        self.check_size(name)
        where = self.storage.describe(self.step, name)
        entry = self.files[name]
        if offset < 0 or length < 0 or offset + length > entry.bytes:
            raise IntegrityError(f"{where}: {length} bytes at {offset} run past the file")
        p = self.storage._p(f"{step_dirname(self.step)}/{name}")
        try:
            data = self.storage._get(p, offset, offset + length) if length else b""
        except StoreUnreachableError:  # the store failed, not the file
            raise
        except OSError as e:
            raise IntegrityError(f"{where}: unreadable ({e})") from None
        if len(data) != length:
            raise IntegrityError(f"{where}: {length} bytes at {offset} not there; it is truncated")
        with self._lock:
            self.bytes_read += length
        return bytearray(data)

    def read_into(self, name: str, offset: int, bufs: list[memoryview]) -> None:
        """Fill ``bufs``, one after another, from one ranged GET of their bytes."""
        data = memoryview(self.read(name, offset, sum(len(b) for b in bufs)))
        at = 0
        for b in bufs:
            b[:] = data[at : at + len(b)]
            at += len(b)


class _Upload:
    """A new object being written: ``close`` publishes it, ``abort`` throws it away."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def write(self, data: Any) -> int:
        """Write ``data`` (buffered; object stores upload in parts and on close)."""
        return int(self._f.write(data))

    def flush(self) -> None:
        """Flush the underlying file (may upload a part)."""
        self._f.flush()

    def writable(self) -> bool:
        """Always true."""
        return True

    def close(self) -> None:
        """Finish the upload: the object appears whole."""
        self._f.close()

    def abort(self) -> None:
        """Drop what was written; nothing is published, a multipart upload is aborted."""
        discard = getattr(self._f, "discard", None)
        if discard is None:
            self._f.close()
            return
        try:
            discard()
        finally:
            # fsspec's buffered files upload on close() and on garbage collection unless
            # marked closed; after discard() there is nothing left that may be published.
            with contextlib.suppress(AttributeError):
                self._f.closed = True


class FsspecStorage(Storage):
    """A store on any fsspec filesystem (``s3://``, ``gs://``, ``memory://`` ...)."""

    atomic_rename: ClassVar[bool] = False
    lockable: ClassVar[bool] = False
    #: Payload files a restore decodes at once (each streamed as WINDOW ranged GETs).
    read_concurrency: ClassVar[int] = 4

    def __init__(self, fs: Any, path: str, url: str) -> None:
        super().__init__(url.rstrip("/"))
        self.fs = fs
        self.path = path.rstrip("/")
        self._looks = threading.local()
        #: s3fs: new objects are written by :class:`~.s3upload.S3Upload`.
        self._s3 = is_s3(fs)
        #: Seconds a 1 MiB slice of an upload's request body may take to go out before the
        #: upload fails (:attr:`~.s3upload.S3Upload.stall`); a replica's is its
        #: ``replica_timeout``. ``None``: no limit.
        self.upload_stall: float | None = None

    def _p(self, rel: str) -> str:
        return posixpath.join(self.path, rel) if rel else self.path

    def _fresh(self, p: str) -> str:
        """Forget cached listings of ``p`` and its parents, so the next query asks the store.

        Returns ``p``. s3fs pops ``p`` and every parent from its ``dircache``; filesystems
        without a listing cache do nothing.
        """
        # DirCache.pop is a read then a delete: a thread invalidating the same entry in
        # between makes it raise KeyError. Once more finishes the parents it skipped.
        for _ in range(2):
            try:
                self.fs.invalidate_cache(p)
                break
            except KeyError:
                continue
        return p

    # ---- one look per object within one read -----------------------------------------

    @contextlib.contextmanager
    def _one_look(self) -> Iterator[None]:
        """Within the block, each object's metadata is fetched from the store once.

        A read in the base class asks whether an object is a regular file, then its size,
        then opens it (which asks for its size again): three HEAD requests on S3 for one
        object, whose answers within one call cannot usefully differ. Outside such a block
        every query asks the store.
        """
        if getattr(self._looks, "infos", None) is not None:
            yield
            return
        self._looks.infos = {}
        try:
            yield
        finally:
            self._looks.infos = None

    @_reaching
    def _info(self, p: str) -> dict[str, Any]:
        infos: dict[str, dict[str, Any]] | None = getattr(self._looks, "infos", None)
        if infos is not None and p in infos:
            return infos[p]
        info: dict[str, Any] = self.fs.info(self._fresh(p))
        if infos is not None:
            infos[p] = info
        return info

    def read_manifest(self, step: int, *, table: bool = True) -> Manifest:
        """As :meth:`Storage.read_manifest`, with one metadata request for the manifest."""
        with self._one_look():
            return super().read_manifest(step, table=table)

    def stream_file(
        self,
        step: int,
        name: str,
        entry: FileEntry,
        consume: Consumer | None = None,
        *,
        pace: Callable[[], None] | None = None,
    ) -> None:
        """As :meth:`Storage.stream_file`, with one metadata request for the file."""
        with self._one_look():
            super().stream_file(step, name, entry, consume, pace=pace)

    def file_size(self, step: int, name: str) -> int | None:
        """As :meth:`Storage.file_size`, with one metadata request for the file."""
        with self._one_look():
            return super().file_size(step, name)

    def range_reader(self, step: int, files: Mapping[str, FileEntry]) -> RangeReader:
        """A reader of byte ranges whose every read is one ranged GET (see :class:`_RangeGets`)."""
        return _RangeGets(self, step, files)

    @_reaching
    def _get(self, p: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of object ``p``: one ranged GET.

        Raises:
            FileNotFoundError: no such object (it was deleted: the step is gone or damaged).
            StoreUnreachableError: any other failure (see :meth:`_no_answer`).
        """
        try:
            return bytes(self.fs.cat_file(p, start=start, end=end))
        except (FileNotFoundError, StoreUnreachableError):
            raise
        except OSError as e:
            raise self._no_answer(e, p) from e

    def _refused(self, e: OSError, p: str) -> OSError:
        """``e`` as it is where it is ours already, else :meth:`_no_answer`'s error."""
        if isinstance(e, StoreUnreachableError):
            return e
        return self._no_answer(e, p)

    def _no_answer(self, e: BaseException, p: str) -> StoreUnreachableError:
        """The error for a request on ``p`` the store refused or failed, not "no such key".

        A 403, or a 503 (``SlowDown``) or 500 still failing after the client's retries, says
        nothing about the checkpoint: taken for a damaged file (as an ``IntegrityError``), it
        made resume skip the step and restore an older one, losing the steps between.
        """
        err = remote_error(e, self.root, StoreUnreachableError)
        if isinstance(err, StoreUnreachableError):
            return err
        text = " ".join(str(e).split()) or type(e).__name__
        return StoreUnreachableError(
            f"{self.root}: the object store failed a request for {p} ({text}); nothing was "
            "skipped or removed: retry once it answers"
        )

    @_reaching
    def _stream(
        self,
        rel: str,
        consume: Consumer | None,
        *,
        crc: bool = True,
        pace: Callable[[], None] | None = None,
    ) -> tuple[int, int]:
        """Read an object as ranged GETs, a few in flight, handed on in order.

        ``pace()`` is called before each GET is issued, as in :meth:`Storage._stream`. The
        size comes from the metadata this read already fetched (``stream_file`` checked it
        against the manifest). Ranges are :data:`RANGE` to :data:`MAX_RANGE` bytes, 2 to
        :data:`WINDOW` of them in flight, at most :data:`IN_FLIGHT` bytes (plus one range).
        """
        p = self._p(rel)
        size = self._size(rel)
        if size == 0:
            return 0, 0
        pool = _getters()
        step = min(MAX_RANGE, max(RANGE, -(-size // 8 // (1 << 20)) << 20))
        window = max(2, min(WINDOW, IN_FLIGHT // step))
        starts = iter(range(0, size, step))
        jobs: collections.deque[tuple[int, concurrent.futures.Future[bytes]]] = collections.deque()
        total = 0
        total_crc = 0
        try:
            while True:
                while len(jobs) < window:
                    start = next(starts, None)
                    if start is None:
                        break
                    end = min(size, start + step)
                    if pace is not None:
                        pace()
                    jobs.append((end - start, pool.submit(self._get, p, start, end)))
                if not jobs:
                    break
                want, fut = jobs.popleft()
                data = fut.result()
                if len(data) != want:
                    raise OSError(f"a ranged GET returned {len(data)} bytes of {want}")
                if crc:
                    total_crc = crc32c_of(data, total_crc)
                if consume is not None:
                    consume(total, memoryview(data))
                total += want
        finally:
            for _, fut in jobs:
                fut.cancel()
        return total, total_crc

    # ---- listing --------------------------------------------------------------------

    @_reaching
    def _list(self, rel: str) -> list[str]:
        p = self._fresh(self._p(rel))
        try:
            entries = self.fs.ls(p, detail=False, refresh=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except TypeError:  # filesystems whose ls takes no refresh
            try:
                entries = self.fs.ls(p, detail=False)
            except (FileNotFoundError, NotADirectoryError):
                return []
            except OSError as e:
                raise self._refused(e, p) from e
        except OSError as e:
            raise self._refused(e, p) from e
        base = p.rstrip("/")
        names = []
        for entry in entries:
            full = str(entry).rstrip("/")
            name = posixpath.basename(full)
            if name and full != base:
                names.append(name)
        return names

    @_reaching
    def _scan(self) -> dict[str, set[str]]:
        """One recursive listing of the store: each root entry -> the files directly in it.

        Entries are taken only from paths strictly below ``ROOT/``, so a store at
        ``s3://b/run1`` never sees ``s3://b/run10``.
        """
        root = self.path.strip("/")
        prefix = f"{root}/" if root else ""
        try:
            found = self.fs.find(self._fresh(self.path), withdirs=True, detail=True)
        except FileNotFoundError:
            return {}
        except OSError as e:  # a listing the store failed (a 5xx after the retries)
            raise self._refused(e, self.path) from e
        entries: dict[str, set[str]] = {}
        for name, info in found.items():
            p = str(name).strip("/")
            if not p.startswith(prefix) or p == root:
                continue
            top, _, rest = p[len(prefix) :].partition("/")
            if not top:
                continue
            files = entries.setdefault(top, set())
            if rest and "/" not in rest and info.get("type") == "file":
                files.add(rest)
        return entries

    def scan(self) -> tuple[list[int], list[str]]:
        """Committed steps and garbage (tmp/trash, manifest-less steps): one listing."""
        entries = self._scan()
        return split_root(entries, lambda top: MANIFEST_NAME in entries[top])

    @_reaching
    def is_pinned(self, step: int) -> bool:
        """Whether the checkpoint carries a pin marker: one listing of its directory.

        Retention asks this of every step on every save. ``exists`` of an absent object
        costs two requests on S3 (a HEAD, then a listing to rule out a "directory").
        """
        return PIN_NAME in self._list(step_dirname(step))

    # ---- queries ------------------------------------------------------------------------

    @_reaching
    def _exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self._fresh(self._p(rel))))

    @_reaching
    def _root_kind(self) -> str:
        # Object stores have no empty directories: a prefix with nothing under it is missing.
        try:
            info = self.fs.info(self._fresh(self.path))
        except FileNotFoundError:
            return "missing"
        return "file" if info.get("type") == "file" else "dir"

    @_reaching
    def _is_regular_file(self, rel: str) -> bool:
        """Whether ``rel`` is an object; raised where the store gives no answer.

        Only "no such key" is an absent file. A refused or failed look-up (403, a 503 still
        failing after the client's retries) is raised, as a local ``lstat`` error is
        (design rule 1): taken for a missing manifest, it made resume skip the newest step
        ("missing or not a regular file") and restore an older one.
        """
        p = self._p(rel)
        try:
            info = self._info(p)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except StoreUnreachableError:
            raise
        except OSError as e:
            raise self._no_answer(e, p) from e
        return info.get("type") == "file"

    @_reaching
    def _size(self, rel: str) -> int:
        return int(self._info(self._p(rel))["size"])

    @_reaching
    def _sizes(self, rel: str) -> dict[str, int]:
        p = self._fresh(self._p(rel))
        try:
            entries = self.fs.ls(p, detail=True, refresh=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except TypeError:  # filesystems whose ls takes no refresh
            try:
                entries = self.fs.ls(p, detail=True)
            except (FileNotFoundError, NotADirectoryError):
                return {}
            except OSError as e:
                raise self._refused(e, p) from e
        except OSError as e:
            raise self._refused(e, p) from e
        return {
            posixpath.basename(str(e["name"]).rstrip("/")): int(e.get("size") or 0)
            for e in entries
            if e.get("type") == "file"
        }

    # ---- writes and reads ---------------------------------------------------------------

    def _mkdir(self, rel: str) -> None:
        self.fs.makedirs(self._p(rel), exist_ok=True)

    def _open_write(self, rel: str) -> IO[bytes]:
        if self._s3:
            # Concurrent parts, each checked by the server against its MD5 (s3upload.py).
            upload = S3Upload(self.fs, self._p(rel), stall=self.upload_stall)
            return upload  # type: ignore[return-value]
        return _Upload(self.fs.open(self._p(rel), "wb"))  # type: ignore[return-value]

    def _finish_write(self, f: IO[bytes], rel: str) -> None:
        f.close()  # for object stores, close() is the (final part of the) upload

    @_reaching
    def _put_small(self, rel: str, data: bytes) -> None:
        # One PUT: the object appears whole or not at all, which is what makes the
        # manifest put the commit.
        self.fs.pipe_file(self._p(rel), data)

    @_reaching
    def _open_read(self, rel: str) -> IO[bytes]:
        p = self._p(rel)
        infos: dict[str, dict[str, Any]] | None = getattr(self._looks, "infos", None)
        info = infos.get(p) if infos is not None else None
        f: Any = None
        if info is not None and "size" in info:
            # Hand the file the metadata this read already fetched, instead of a HEAD.
            with contextlib.suppress(TypeError):  # an open() that takes no size
                f = self.fs.open(p, "rb", size=info["size"])
            if f is not None and hasattr(type(f), "details"):
                f.details = info  # fsspec buffered files fetch it on first read otherwise
        if f is None:
            # The size a buffered file reads up to comes from ``info``: a stale one would
            # hide bytes appended by another process.
            f = self.fs.open(self._fresh(p), "rb")
        if not hasattr(f, "readinto"):
            f = io.BufferedReader(f)
        return f  # type: ignore[no-any-return]

    @_reaching
    def entry_age(self, name: str) -> float | None:
        """Seconds since the newest object under the root entry ``name`` was written.

        From each object's ``LastModified`` (or the filesystem's ``mtime``/``created``);
        None where an object does not say, or there are none.
        """
        try:
            found = self.fs.find(self._fresh(self._p(name)), detail=True)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._refused(e, self._p(name)) from e
        stamps = [_stamp(info) for info in found.values()]
        known = [t for t in stamps if t is not None]
        if not known or len(known) < len(stamps):
            return None  # an object of unknown age may be the one just written
        return max(0.0, time.time() - max(known))

    @_reaching
    def abort_incomplete_uploads(
        self, older_than: float | None = None, keep: Callable[[str], bool] | None = None
    ) -> int:
        """Abort the S3 multipart uploads under the root (a crashed upload's parts).

        Lists them with the root as prefix (``ListMultipartUploads``), so uploads of other
        stores in the bucket are never touched. Filesystems other than s3fs have none.
        ``older_than``: only uploads initiated at least that many seconds ago (a younger
        one may be another process's, still sending its parts). ``keep``: given the root
        entry an upload is under (``step-…``), whether to leave its uploads alone (one
        still being written to: moto gives every upload the same ``Initiated`` of 2010).
        """
        raw = getattr(self.fs, "call_s3", None)
        if raw is None:
            return 0

        def call(method: str, **kw: Any) -> Any:
            # call_s3 hands out botocore's own errors (EndpointConnectionError, ClientError),
            # which s3fs's file methods translate: do the same, so callers see an OSError.
            try:
                return raw(method, **kw)
            except OSError:
                raise
            except Exception as e:
                err = remote_error(e, self.root, StoreUnreachableError)  # an OSError too
                if err is not None:
                    raise err from e  # says what to check: credentials, endpoint, access
                raise OSError(f"{method} under {self.root} failed: {e}") from e

        bucket, _, key = self.path.strip("/").partition("/")
        prefix = f"{key}/" if key else ""
        aborted = 0
        kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        while True:
            out = call("list_multipart_uploads", **kw)
            for up in out.get("Uploads", []):
                key = str(up["Key"])
                # The prefix is literal for S3; check again so a store never reaches outside
                # (and an entry's age is never asked of a key outside the root).
                if not key.startswith(prefix):
                    continue
                if older_than is not None:
                    began = _stamp({"LastModified": up.get("Initiated")})
                    if began is None or time.time() - began < older_than:
                        continue
                if keep is not None and keep(key[len(prefix) :].partition("/")[0]):
                    continue
                call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=up["UploadId"])
                aborted += 1
            if not out.get("IsTruncated"):
                return aborted
            kw["KeyMarker"] = out.get("NextKeyMarker", "")
            kw["UploadIdMarker"] = out.get("NextUploadIdMarker", "")

    # ---- removal --------------------------------------------------------------------

    @_reaching
    def _copy(self, src: str, dst: str) -> None:
        # Server-side on S3 and GCS (CopyObject): the bytes never pass through this process.
        self.fs.copy(self._p(src), self._fresh(self._p(dst)))

    @_reaching
    def _remove(self, rel: str) -> None:
        self.fs.rm_file(self._p(rel))

    @_reaching
    def _rmtree(self, rel: str) -> None:
        p = self._p(rel)
        if not _GLOB_CHARS.search(p):
            self.fs.rm(self._fresh(p), recursive=True)
            return
        # ``rm`` would expand the path as a glob and reach outside the store; list it
        # literally (``find`` does not glob) and remove each object by its exact name.
        found = self.fs.find(self._fresh(p), withdirs=True, detail=True)
        if not found:
            raise FileNotFoundError(p)
        dirs = []
        for name, info in found.items():
            if info.get("type") == "directory":
                dirs.append(name)
            else:
                self.fs.rm_file(name)
        for d in sorted(dirs, key=len, reverse=True):  # deepest first; none on S3
            with contextlib.suppress(OSError):
                self.fs.rmdir(d)


def _stamp(info: Mapping[str, Any]) -> float | None:
    """When an object was written (seconds since the epoch), from a listing's details."""
    import datetime

    for key in ("LastModified", "mtime", "created"):
        value = info.get(key)
        if isinstance(value, datetime.datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=datetime.timezone.utc)
            return value.timestamp()
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None
