"""Uploads to S3 whose bytes the server checks: one PUT, or concurrent multipart parts.

:class:`S3Upload` is the writer :class:`~ckptstore.storage.remote.FsspecStorage` hands out
for a new object on s3fs (instead of s3fs's buffered file, which sends one part at a time
and waits for it inside ``write``). What it does with the bytes written to it:

- **Small objects, one PUT.** The bytes are held until the object reaches
  :data:`SINGLE_PUT`; an object closed before that goes as one ``PutObject`` (what
  ``s3fs.put`` does below twice its 50 MiB chunk: moto spends about 1.5x the CPU on a
  multipart upload of the same bytes, and a single request is atomic). Where the store
  computes the CRC32C itself (:data:`COMPUTES`, below), an object said by
  :meth:`S3Upload.expect` to be at least 8 MiB starts its PUT at once and its body follows
  the writes (reading the file and sending it overlap); fewer bytes than said abort it.
- **Large objects, parts in flight.** Past :data:`SINGLE_PUT` a multipart upload is created
  and parts of :data:`PART` bytes are sent as they fill, up to :data:`IN_FLIGHT` of them at
  once per object (``write`` waits only when that many are unanswered); ``close`` sends the
  last one and completes the upload (an object said to be that large by
  :meth:`S3Upload.expect` starts its multipart upload at once). Memory held per object: at most
  ``max(SINGLE_PUT, (IN_FLIGHT + 1) * PART)`` bytes (the part size doubles every
  :data:`GROW_EVERY` parts, past 16 GB).
- **Every byte is checked by the store, without reading back.** What a store checks is
  found once per client and bucket (:meth:`S3Upload._probe`, two requests on a small object
  next to the first one written, deleted after), and each body is checked the cheapest
  honest way it allows:

  - :data:`VERIFIES` (S3): a PUT whose ``x-amz-checksum-crc32c`` is wrong is refused
    (``BadDigest``). Each request carries the CRC32C of its body; S3 refuses a body that is
    not those bytes and stores nothing. A multipart upload is a ``FULL_OBJECT`` CRC32C one,
    completed with the whole object's CRC32C (the manifest's), which S3 checks against the
    parts. No MD5 is computed.
  - :data:`COMPUTES` (moto, whose server checks neither Content-MD5 nor a sent checksum): a
    request carrying only the ``x-amz-sdk-checksum-algorithm: CRC32C`` header makes the
    server compute the CRC32C of the bytes it received and answer it; the answer is
    compared with the CRC32C of our buffer (a mismatch aborts the upload). A reply without
    it (a client re-made without our hook) leaves the object unverified: the caller reads
    it back. No MD5 is computed by us.
  - :data:`MD5` (neither; or a store that refuses the checksum arguments, which is then
    asked without them): each request carries the MD5 of its body (``Content-MD5``, which
    S3-compatible stores check), computed as the bytes are written (:meth:`S3Upload.expect`),
    and the ETag answered (the MD5 of what the store received, for unencrypted and SSE-S3
    objects; with SSE-KMS or SSE-C it is not, and Content-MD5 is what holds) is compared
    with it.

  In every mode the completed multipart object's ETag is compared with the MD5 of its
  parts' MD5s (ours, or those the store answered for the parts it checked) and their count,
  so the object is exactly the parts sent, in order; the parts' CRC32Cs, combined, must
  equal the CRC32C of the bytes written. The bytes checked are those in this writer's
  buffers, whose CRC32C (:attr:`S3Upload.crc`) the caller compares with the manifest: a file
  uploaded through this writer is verified end to end without reading it back
  (:attr:`S3Upload.verified`). ``s3fs.put`` checks less: botocore signs its body with
  SHA256 over http (over https it does not) and adds a CRC32 that moto does not check.
- **No hashing or copying that is not needed.** The upload client signs no payload
  (``UNSIGNED-PAYLOAD``: the signature covers the Content-MD5 / CRC32C headers, which
  check the body; botocore does the same over https) and adds no CRC32 of its own
  (:func:`_upload_config`). A body is handed to aiohttp as an async iterable of memoryview
  slices of the buffer (:class:`_Body`): each goes to the socket as it is, where aiohttp
  copied a ``bytearray`` body whole twice and asyncio a third time.
- **A save stops the requests in flight.** Each body slice waits at the uploader's gate
  (:class:`~ckptstore.tiers.uploadgate.UploadGate`, set by :meth:`S3Upload.expect`): while a
  save is in its blocking section no byte of an upload is sent.
- **A failure leaves nothing.** :meth:`S3Upload.abort` (and a failing ``close``) cancels the
  parts in flight and aborts the multipart upload; a process killed meanwhile leaves an
  incomplete upload that ``abort_incomplete_uploads`` finds under the store's root. (A
  single PUT whose ETag does not match was stored: it is a payload of a pending step, which
  the commit protocol's abort removes, and no manifest ever names it.)

The requests run on an event loop of their own (:func:`upload_loop`), on a thread at the
lowest CPU priority, through an s3fs instance bound to that loop: the HTTP and signing work
of uploads never competes at normal priority with the training thread (fsspec's own loop
thread, which serves reads, keeps its priority). CRC32C (and MD5 where needed) are computed
on each slice as it is copied into the buffer (hashlib and crc32c release the GIL for large
buffers), in one pass per byte for the object's CRC32C, each part's and, for a shard file,
its chunks' block CRCs (``write(data, sub)``; see ``integrity.SubBlocks``); bytes are copied
into the buffers 1 MiB at a time (a copy holds the GIL): a few Python calls per MiB.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import hashlib
import os
import re
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..errors import IntegrityError, ReplicaError, StoreUnreachableError
from ..integrity import BlockCRC, BlockSums, SubBlocks, crc32c_combine, crc32c_of
from ..tiers.uploadgate import STOPPED, UploadGate
from .reach import is_unreachable
from .s3client import _asking_crc32c, is_s3, upload_fs, upload_loop

__all__ = [
    "GROW_EVERY",
    "IN_FLIGHT",
    "PART",
    "SINGLE_PUT",
    "S3Upload",
    "is_s3",
    "upload_fs",
    "upload_loop",
]

#: Bytes of one multipart part (S3: at least 5 MiB but the last; at most 10,000 parts). The
#: part size doubles every :data:`GROW_EVERY` parts, so 10,000 parts hold any object.
PART = 16 << 20
GROW_EVERY = 1000
#: Objects smaller than this are sent as one PUT.
SINGLE_PUT = 100 << 20
#: Parts of one object sent at once.
IN_FLIGHT = 4
#: S3's limit on the parts of one upload.
MAX_PARTS = 10_000
#: Bytes copied into a buffer per step: a copy holds the GIL, the training thread may be
#: waiting for it (and this thread, at nice 19, may be off the CPU meanwhile).
_COPY_SLICE = 1 << 20
#: Bytes of a request body handed to the socket at once (a memoryview of the buffer).
_SEND_SLICE = 1 << 20
#: Objects of at least this many bytes sent as one PUT start it as they are written, where the
#: store computes the CRC32C itself (:data:`COMPUTES`: no checksum header is needed first).
_STREAM_MIN = 8 << 20
#: Seconds between two looks of a streamed body for more bytes written.
_STREAM_POLL = 0.002
#: Server-side encryptions whose ETags are not the MD5 of the bytes.
_OPAQUE_ETAG = ("aws:kms", "aws:kms:dsse")
_MD5_HEX = re.compile(r"^[0-9a-f]{32}$")
_MULTIPART_ETAG = re.compile(r"^[0-9a-f]{32}-[0-9]+$")


#: What a store checks of the bytes it receives, found once per s3fs clone and bucket by
#: :meth:`S3Upload._probe` (see the module docstring):
#: it refuses a body whose ``x-amz-checksum-crc32c`` is not the body's (S3);
VERIFIES = "verifies"
#: it does not, but computes a body's CRC32C when asked and answers it (moto);
COMPUTES = "computes"
#: neither: each body carries its Content-MD5 and the ETag answered is compared with it.
MD5 = "md5"
_store_checks: dict[tuple[Any, str], str] = {}
_probe_lock = threading.Lock()


def _forget_after_fork() -> None:
    # A forked child has not probed its stores, and the lock may have been held by another
    # thread at the fork (the upload loop and its clients: s3client's own handler).
    global _probe_lock
    _store_checks.clear()
    _probe_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


async def _asking(coro: Any) -> Any:
    _asking_crc32c.set(True)  # in this task's own context: this request only
    return await coro


class _Body:
    """A request body sent straight from a buffer, slice by slice, through the gate.

    aiohttp sends an async iterable body chunk by chunk: each slice (a memoryview of the
    buffer, no copy) goes to the socket as it is, and only what the socket does not take at
    once is copied into the transport's buffer (a ``bytearray`` body is first copied whole
    by aiohttp, then joined with the headers, then copied again into the transport). Before
    each slice the body waits at ``gate`` (:meth:`~ckptstore.tiers.uploadgate.UploadGate.admit`):
    a save in its blocking section stops the requests in flight.

    ``read``/``seek``/``tell``/``len`` are the file-like face botocore sees (it checks a
    body's type, takes its length, and seeks to 0 before a retry); with payload signing off
    (:func:`_upload_config`) it reads nothing.
    """

    def __init__(
        self, data: Any, gate: UploadGate | None, ready: Callable[[], int] | None = None
    ) -> None:
        self._mv = memoryview(data).cast("B")
        self._gate = gate
        self._pos = 0
        #: For a body sent as it is written: how many of its bytes are there so far.
        self._ready = ready
        #: When the slice the client is sending now was handed to it (``None`` while the
        #: body waits for its bytes or at the gate, and once it is sent): a client that does
        #: not ask for the next slice within the stall timeout cannot write to the socket.
        self.handed_at: float | None = None

    def __len__(self) -> int:
        return len(self._mv) - self._pos

    def read(self, n: int = -1) -> bytes:
        """Bytes from the position on (a copy; botocore's fallback, not the send path)."""
        end = len(self._mv) if n is None or n < 0 else min(len(self._mv), self._pos + n)
        out = bytes(self._mv[self._pos : end])
        self._pos = end
        return out

    def seek(self, pos: int, whence: int = 0) -> int:
        """Move the position (``whence`` as :meth:`io.IOBase.seek`)."""
        base = (0, self._pos, len(self._mv))[whence]
        self._pos = max(0, min(len(self._mv), base + pos))
        return self._pos

    def tell(self) -> int:
        """The position."""
        return self._pos

    def __aiter__(self) -> AsyncIterator[memoryview]:
        return self._slices(self._pos)

    async def _slices(self, start: int) -> AsyncIterator[memoryview]:
        for i in range(start, len(self._mv), _SEND_SLICE):
            piece = self._mv[i : i + _SEND_SLICE]
            while self._ready is not None and self._ready() < i + len(piece):
                if self._gate is not None and not self._gate.is_open:
                    # The writer waits at the gate too: no polling while a save runs.
                    await self._gate.opened(self._gate.max_stall)
                else:
                    await asyncio.sleep(_STREAM_POLL)  # not copied in yet
            if self._gate is not None:
                await self._gate.admit(len(piece))
            self.handed_at = time.monotonic()
            yield piece
            self.handed_at = None  # sent: the client asks for the next


#: s3fs clones that refused S3's checksum arguments (see S3Upload._request).
_takes_checksums: dict[Any, bool] = {}


def _refused_checksum(e: OSError) -> bool:
    text = str(e).lower()
    return "checksum" in text or "notimplemented" in text or "not implemented" in text


def _bad_digest(e: OSError) -> bool:
    """Whether ``e`` is S3's answer to a body whose checksum is not the one sent."""
    text = str(e).lower()
    return "baddigest" in text or "did not match" in text


def _b64crc(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def _md5(data: Any) -> bytes:
    return hashlib.md5(data, usedforsecurity=False).digest()


def _etag(out: Any) -> str:
    return str(out.get("ETag", "")).strip('"').lower()


class S3Upload(BlockSums):
    """A new S3 object being written: ``close`` publishes it, ``abort`` throws it away.

    Also a checksumming writer (``crc``, ``nbytes``, ``blocks``), computed on the buffers
    that are sent. Not thread-safe: one writer per thread, as a file.

    Args:
        fs: the store's s3fs filesystem (its options are used; see :func:`upload_fs`).
        path: ``bucket/key`` of the object.
        part: bytes of one part (default: the store's ``default_block_size`` option where
            given, else :data:`PART`).
        single_put: objects below this many bytes go as one PUT (default: that option,
            else :data:`SINGLE_PUT`); rounded up to whole parts.
        in_flight: parts of this object sent at once.
        stall: see :attr:`stall` (a replica's ``replica_timeout``).
    """

    def __init__(
        self,
        fs: Any,
        path: str,
        *,
        part: int | None = None,
        single_put: int | None = None,
        in_flight: int = IN_FLIGHT,
        stall: float | None = None,
    ) -> None:
        if part is None or single_put is None:
            # The store's own ``default_block_size`` option, where given, is its part size,
            # and objects below one part go as one PUT (as s3fs's writer does with it).
            block = getattr(fs, "storage_options", {}).get("default_block_size")
            if isinstance(block, int) and block >= 5 << 20:
                part, single_put = part or block, single_put or block
            part, single_put = part or PART, single_put or SINGLE_PUT
        self._fs = upload_fs(fs)
        self._loop = upload_loop()
        self.bucket, self.key, _ = fs.split_path(path)
        self.path = path
        self.part = part
        self.single_put = -(-max(single_put, part) // part) * part  # whole parts
        self.in_flight = max(1, in_flight)
        self._sum = BlockCRC()
        #: The CRC32C of each part, from the same pass as ``_sum`` (fed by :meth:`write`):
        #: every part-sized block of the object held before the multipart upload starts,
        #: then the part filling (a new one per part: the part size may grow).
        self._part_sum = SubBlocks(self.part)
        #: The object so far (before the multipart upload starts), then the part filling.
        self._cur = bytearray()
        self._upload_id: str | None = None
        #: (number, md5 where kept, crc32c, reply)
        self._sent: list[tuple[int, bytes | None, int, concurrent.futures.Future[Any]]] = []
        self._done: list[tuple[int, bytes | None, str, str]] = []  # (number, md5, etag, crc)
        self._number = 0
        self._sent_crc = 0  # CRC32C of the parts sent so far, in order
        self._sent_bytes = 0
        self._done_crc: list[str] = []  # each part's CRC32C as sent, by part number - 1
        self._closed = False
        #: The server checked every byte it received (set by a successful ``close``).
        self.verified = False
        #: The uploader's gate: each request body waits there before each slice it sends.
        self.gate: UploadGate | None = None
        #: The running MD5 of ``_cur`` (after :meth:`expect`), else computed at the send.
        self._md5: Any = None
        #: What the store checks (:data:`VERIFIES`, :data:`COMPUTES`, :data:`MD5`).
        self._checks: str | None = None
        #: A request whose bytes the store was to check came back without the check.
        self._unchecked: list[str] = []
        #: A PUT sent as its bytes are written (see :meth:`expect`): its buffer, of the size
        #: said, the bytes written into it so far, and the request's reply.
        self._streamed: bytearray | None = None
        self._filled = 0
        self._streaming: concurrent.futures.Future[Any] | None = None
        #: Seconds one slice of a request body (``_SEND_SLICE``, 1 MiB) may take to go out
        #: (an endpoint that accepts a connection and then takes no byte: no client timeout
        #: covers a write) before the upload is aborted; ``None``: no limit.
        self.stall = stall
        #: The request bodies in flight, watched by :meth:`_wait` (weakly: a body is the
        #: request's, and holds a part's buffer until the request is done with it).
        self._bodies: list[weakref.ref[_Body]] = []

    # ---- the checksumming-writer interface -------------------------------------------

    #: :meth:`write` takes ``sub=`` (``safetensors.write_laid_out`` asks).
    sub_blocks = True

    @property
    def nbytes(self) -> int:
        """Bytes written."""
        return self._sum.nbytes

    def writable(self) -> bool:
        """Always true."""
        return True

    def flush(self) -> None:
        """Nothing: parts go when they are full, the rest on ``close``."""

    # ---- writing ---------------------------------------------------------------------

    def expect(self, nbytes: int, *, gate: UploadGate | None = None) -> None:
        """Say, before the first write, that ``nbytes`` will be written; set the gate.

        The MD5 of each body is then computed as its bytes are written (a slice at a time,
        while the next is read) rather than in one pass before its request, and an object
        that will be sent in parts starts its multipart upload now (its first part goes as
        soon as it is full, and no whole-object MD5 is computed for nothing). More or fewer
        bytes than said are still uploaded correctly. ``gate``: see :class:`_Body`.
        """
        if self._sum.nbytes or self._upload_id is not None or self._closed:
            raise ValueError(f"expect() after the first write to {self.path}")
        self.gate = gate
        checks = self._store_checks()
        if checks == MD5:
            self._md5 = hashlib.md5(usedforsecurity=False)
        if nbytes >= self.single_put:
            self._go_multipart()
        elif checks == COMPUTES and nbytes >= _STREAM_MIN:
            # The store answers the CRC32C of what it received: the PUT needs no checksum
            # first, so it starts now and its body goes as the bytes are written.
            self._streamed = bytearray(nbytes)
            self._streaming = self._submit(
                "put_object",
                ask_crc32c=True,
                Bucket=self.bucket,
                Key=self.key,
                Body=self._body(self._streamed, ready=lambda: self._filled),
            )

    def _take_md5(self) -> bytes | None:
        """The running MD5 of ``_cur`` (then restarted for the next body); None if not kept."""
        if self._md5 is None:
            return None
        digest: bytes = self._md5.digest()
        self._md5 = hashlib.md5(usedforsecurity=False)
        return digest

    def write(self, data: Any, sub: SubBlocks | None = None) -> int:
        """Buffer ``data`` (checksummed in the buffer); send the parts it fills.

        The bytes are copied once, into the buffer that is sent, and checksummed there in one
        pass: the CRC32C the caller compares with the manifest, each part's (sent with it),
        and ``sub``'s blocks (a shard's tensor: its chunk CRCs) are those of the bytes sent.
        """
        if self._closed:
            raise ValueError(f"write to a closed upload of {self.path}")
        mv = memoryview(data).cast("B")
        n = len(mv)
        if self._streamed is not None:
            return self._write_streamed(mv, sub)
        done = 0
        while done < n:
            room = (self.single_put if self._upload_id is None else self.part) - len(self._cur)
            k = min(n - done, room, _COPY_SLICE)
            start = len(self._cur)
            self._cur += mv[done : done + k]
            grids = (self._part_sum,) if sub is None else (sub, self._part_sum)
            with memoryview(self._cur) as whole, whole[start:] as piece:
                self._sum.update(piece, grids)
                if self._md5 is not None:
                    self._md5.update(piece)
            done += k
            if k < room:
                continue
            if self._upload_id is None:
                self._go_multipart()
            else:
                full, self._cur = self._cur, bytearray()
                self._send(full, self._part_crc(), self._take_md5())
        return n

    def _part_crc(self) -> int:
        """The CRC32C of the part filling (full, or the last); :meth:`_send` starts the next."""
        crcs = self._part_sum.close()
        return crcs[-1] if crcs else 0

    def _write_streamed(self, mv: memoryview, sub: SubBlocks | None) -> int:
        """``write`` for a PUT sent as it is written: into its buffer, then counted ready."""
        assert self._streamed is not None
        n = len(mv)
        if self._filled + n > len(self._streamed):
            raise IntegrityError(
                f"s3://{self.path}: more than the {len(self._streamed)} bytes said were "
                "written; the upload is aborted"
            )
        for done in range(0, n, _COPY_SLICE):
            k = min(n - done, _COPY_SLICE)
            at = self._filled
            self._streamed[at : at + k] = mv[done : done + k]
            with memoryview(self._streamed) as whole, whole[at : at + k] as piece:
                self._sum.update(piece, sub)
            self._filled = at + k  # the body may send them now
        return n

    def _go_multipart(self) -> None:
        """The object outgrew one PUT: start a multipart upload, send what is held as parts."""
        out = self._request(
            "create_multipart_upload",
            Bucket=self.bucket,
            Key=self.key,
            **self._checksum(ChecksumAlgorithm="CRC32C", ChecksumType="FULL_OBJECT"),
        )
        self._upload_id = str(out["UploadId"])
        held, self._cur = self._cur, bytearray()
        # Whole parts (single_put is), each sent as a slice of the buffer its CRC32C was
        # computed in (the part grid of the same pass): no copy. ``held`` is never resized.
        crcs = self._part_sum.close()
        cut = range(0, len(held), self.part)
        for i, crc in zip(cut, crcs, strict=True):
            self._send(memoryview(held)[i : i + cut.step], crc)
        self._check_sent()
        if self._md5 is not None:  # the held bytes' MD5 is no part's: start the next part's
            self._md5 = hashlib.md5(usedforsecurity=False)

    def close(self) -> None:
        """Send what is left and publish the object (all parts checked); idempotent."""
        if self._closed:
            return
        try:
            if self._streaming is not None:
                self._finish_streamed()
            elif self._upload_id is None:
                self._put_whole()
            else:
                if self._cur or not self._number:
                    self._send(self._cur, self._part_crc(), self._take_md5())
                self._cur = bytearray()
                self._complete()
        except BaseException as e:
            self.abort(ask=not is_unreachable(e))
            raise
        self._closed = True
        # A store that computes CRC32Cs but answered none for a request (a client s3fs
        # re-made without our hook): the caller reads the object back.
        self.verified = not self._unchecked

    def abort(self, *, ask: bool = True) -> None:
        """Drop what was written: parts in flight cancelled, the multipart upload aborted.

        ``ask=False``: the endpoint stopped answering; the multipart upload is left for the
        next uploader's recover() to abort (asking would wait on the client's timeouts).
        """
        self._closed = True
        self._cur = bytearray()
        streaming, self._streaming = self._streaming, None
        if streaming is not None:  # a PUT cut short: the store keeps nothing of it
            streaming.cancel()
            with contextlib.suppress(BaseException):
                streaming.result(timeout=60)
        for *_, fut in self._sent:
            fut.cancel()
        for *_, fut in self._sent:
            with contextlib.suppress(BaseException):
                fut.result(timeout=60)
        self._sent.clear()
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is not None and ask and not self._stopped():
            with contextlib.suppress(Exception):  # recover() aborts what is left
                self._call(
                    "abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=upload_id
                )

    # ---- requests ----------------------------------------------------------------------

    def _stopped(self) -> bool:
        """Whether the uploader whose gate this upload passes was stopped."""
        return self.gate is not None and self.gate.stopped

    def _submit(
        self, method: str, *, ask_crc32c: bool = False, **kw: Any
    ) -> concurrent.futures.Future[Any]:
        if self._stopped():  # no new request for an upload being abandoned
            raise ReplicaError(f"s3://{self.path}: {STOPPED}")
        coro = self._fs._call_s3(method, **kw)
        if ask_crc32c:
            coro = _asking(coro)
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, method: str, **kw: Any) -> Any:
        return self._wait(self._submit(method, **kw))

    def _body(self, data: Any, ready: Callable[[], int] | None = None) -> _Body:
        """A request body of this upload, watched by :meth:`_wait`."""
        self._bodies = [r for r in self._bodies if r() is not None]
        body = _Body(data, self.gate, ready)
        self._bodies.append(weakref.ref(body))
        return body

    def _stalled(self, stall: float) -> bool:
        """Whether a body in flight has had a slice unsent for ``stall`` seconds."""
        now = time.monotonic()
        for ref in self._bodies:
            body = ref()
            handed = None if body is None else body.handed_at
            if handed is not None and now - handed > stall:
                return True
        return False

    def _wait(self, fut: concurrent.futures.Future[Any]) -> Any:
        """``fut.result()``; raises once a body of this upload stalls past :attr:`stall`.

        Waiting for an answer is bounded by the client (``read_timeout``); writing a body
        to a socket the endpoint no longer reads is not, and ``close()`` hung for good.

        The uploader's stop (:meth:`~ckptstore.tiers.uploadgate.UploadGate.stop`) cancels
        the request as well: a Ctrl-C or a ``close()`` without waiting does not wait for it.

        Raises:
            StoreUnreachableError: a body sat unsent for :attr:`stall` seconds (the request
                is cancelled; the caller aborts the upload).
            ReplicaError: the uploader was stopped (the request is cancelled).
        """
        if self.stall is None and self.gate is None:
            return fut.result()
        while True:
            try:
                return fut.result(timeout=min(1.0, self.stall or 1.0))
            except concurrent.futures.TimeoutError:
                if fut.done():
                    raise
            if self._stopped():
                fut.cancel()
                raise ReplicaError(f"s3://{self.path}: {STOPPED}")
            if self.stall is not None and self._stalled(self.stall):
                fut.cancel()
                raise StoreUnreachableError(
                    f"s3://{self.path}: the object store took less than 1 MiB of a request "
                    f"in {self.stall:g}s (replica_timeout); the upload is aborted"
                )

    def _store_checks(self) -> str:
        """What the store checks of a body (:meth:`_probe` once per client and bucket)."""
        if self._checks is None:
            key = (self._fs, self.bucket)
            with _probe_lock:
                if key not in _store_checks:
                    _store_checks[key] = self._probe()
                self._checks = _store_checks[key]
        return self._checks

    def _probe(self) -> str:
        """Find out what the store checks, with a small object next to this one.

        First a PUT whose ``x-amz-checksum-crc32c`` is wrong: S3 refuses it (BadDigest),
        :data:`VERIFIES`. A store that takes it does not check that header: a PUT that asks
        it to compute the CRC32C (the algorithm header alone) tells whether it answers the
        right one, :data:`COMPUTES`; else :data:`MD5`. The object is deleted after.
        """
        if not _takes_checksums.get(self._fs, True):
            return MD5
        key = f"{self.key}.ckptstore-probe"
        body = b"ckptstore: does this store check the bytes it receives?\n"
        crc = _b64crc(crc32c_of(body))
        wrong = _b64crc(crc32c_of(body) ^ 0xFFFFFFFF)
        answered = True  # an endpoint that answered nothing is not asked to delete
        try:
            try:
                self._call(
                    "put_object",
                    Bucket=self.bucket,
                    Key=key,
                    Body=body,
                    ChecksumAlgorithm="CRC32C",
                    ChecksumCRC32C=wrong,
                )
            except OSError as e:
                if _bad_digest(e):
                    return VERIFIES
                if _refused_checksum(e):
                    _takes_checksums[self._fs] = False
                    return MD5
                raise
            out = self._submit(
                "put_object", ask_crc32c=True, Bucket=self.bucket, Key=key, Body=body
            )
            return COMPUTES if self._wait(out).get("ChecksumCRC32C") == crc else MD5
        except BaseException as e:
            answered = not is_unreachable(e)
            raise
        finally:
            if answered:
                with contextlib.suppress(Exception):
                    self._call("delete_object", Bucket=self.bucket, Key=key)

    def _body_checks(
        self, crc: int, md5: bytes | None, body: Any
    ) -> tuple[bytes | None, dict[str, Any]]:
        """The MD5 kept for a body (MD5 mode only) and the arguments that check it."""
        checks = self._store_checks()
        if checks == COMPUTES:
            return None, {}
        crc_args = {"ChecksumAlgorithm": "CRC32C", "ChecksumCRC32C": _b64crc(crc)}
        if checks == VERIFIES:
            return None, crc_args
        md5 = md5 or _md5(body)
        return md5, {"ContentMD5": base64.b64encode(md5).decode(), **self._checksum(**crc_args)}

    def _check_reply(self, out: Any, crc: int, md5: bytes | None, what: str) -> None:
        """Check what the store answered for a body of CRC32C ``crc`` (and MD5 ``md5``)."""
        checks = self._store_checks()
        if checks == MD5 and md5 is not None:
            self._check_etag(out, md5.hex(), what)
        elif checks == COMPUTES:
            got = out.get("ChecksumCRC32C")
            if got is None:
                self._unchecked.append(what)
            elif got != _b64crc(crc):
                raise IntegrityError(
                    f"s3://{self.path}: the server's CRC32C of {what} is {got!r}, that of the "
                    f"bytes sent is {_b64crc(crc)!r}: they were changed on the way; the upload "
                    "is aborted"
                )
        # VERIFIES: the store refused a body whose CRC32C was not the one sent.

    def _checksum(self, **kw: Any) -> dict[str, Any]:
        """``kw`` where the store takes S3's checksum arguments, else nothing."""
        return kw if _takes_checksums.get(self._fs, True) else {}

    def _request(self, method: str, *, ask_crc32c: bool = False, **kw: Any) -> Any:
        """One request that starts an object; without checksum arguments where refused.

        S3 checks a ``ChecksumCRC32C`` itself; a store that does not know the arguments
        (older S3-compatible servers) refuses them, and is asked again without them (it is
        remembered). Content-MD5, which every S3 store checks, is kept.
        """
        try:
            return self._wait(self._submit(method, ask_crc32c=ask_crc32c, **kw))
        except OSError as e:
            plain = {k: v for k, v in kw.items() if not k.startswith("Checksum")}
            if plain == kw or not _refused_checksum(e) or isinstance(e, StoreUnreachableError):
                raise
            _takes_checksums[self._fs] = False
            return self._wait(self._submit(method, ask_crc32c=ask_crc32c, **plain))

    def _finish_streamed(self) -> None:
        """Check the size said, wait for the streamed PUT's reply and check it."""
        assert self._streamed is not None
        assert self._streaming is not None
        if self._filled != len(self._streamed):
            raise IntegrityError(
                f"s3://{self.path}: {self._filled} bytes were written, {len(self._streamed)} "
                "said; the upload is aborted"
            )
        out = self._wait(self._streaming)
        self._streaming = None
        self._streamed = None
        self._check_reply(out, self._sum.crc, None, "the object")

    def _put_whole(self) -> None:
        body, self._cur = self._cur, bytearray()
        # The checksummed buffer itself is the body: no copy in between.
        md5, checks = self._body_checks(self._sum.crc, self._take_md5(), body)
        out = self._request(
            "put_object",
            ask_crc32c=self._store_checks() == COMPUTES,
            Bucket=self.bucket,
            Key=self.key,
            Body=self._body(body),
            **checks,
        )
        self._check_reply(out, self._sum.crc, md5, "the object")

    def _send(
        self, body: bytes | bytearray | memoryview, crc: int, md5: bytes | None = None
    ) -> None:
        """Send ``body`` (whose CRC32C is ``crc``, MD5 ``md5`` where known) as the next part.

        Waits first while :attr:`in_flight` parts are unanswered.
        """
        while len(self._sent) >= self.in_flight:
            self._reap()
        self._number += 1
        if self._number > MAX_PARTS:
            raise OSError(f"{self.path}: more than {MAX_PARTS} parts of {self.part} bytes")
        if self._number % GROW_EVERY == 0:
            self.part *= 2  # the parts after this one (each part's size is its body's)
        md5, checks = self._body_checks(crc, md5, body)
        fut = self._submit(
            "upload_part",
            ask_crc32c=self._store_checks() == COMPUTES,
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self._upload_id,
            PartNumber=self._number,
            Body=self._body(body),
            **checks,
        )
        self._sent.append((self._number, md5, crc, fut))
        self._done_crc.append(_b64crc(crc))
        self._sent_crc = crc32c_combine(self._sent_crc, crc, len(body))
        self._sent_bytes += len(body)
        self._part_sum = SubBlocks(self.part)  # the next part's, of the size it will have

    def _check_sent(self) -> None:
        """The parts sent are, in order, the bytes checksummed (none lost, none copied wrong)."""
        if (self._sent_bytes, self._sent_crc) != (self._sum.nbytes, self._sum.crc):
            raise IntegrityError(
                f"s3://{self.path}: the parts sent ({self._sent_bytes} bytes, crc32c "
                f"{self._sent_crc:08x}) are not the bytes written ({self._sum.nbytes} bytes, "
                f"crc32c {self._sum.crc:08x}); the upload is aborted"
            )

    def _reap(self) -> None:
        number, md5, crc, fut = self._sent.pop(0)
        out = self._wait(fut)
        self._check_reply(out, crc, md5, f"part {number}")
        self._done.append((number, md5, _etag(out), self._done_crc[number - 1]))

    def _complete(self) -> None:
        while self._sent:
            self._reap()
        self._check_sent()
        crcs = self._checksum(ChecksumCRC32C=True)
        parts = [
            {"PartNumber": n, "ETag": f'"{etag}"', **({"ChecksumCRC32C": c} if crcs else {})}
            for n, _, etag, c in self._done
        ]
        out = self._call(
            "complete_multipart_upload",
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self._upload_id,
            MultipartUpload={"Parts": parts},
            **self._checksum(ChecksumCRC32C=_b64crc(self._sum.crc), ChecksumType="FULL_OBJECT"),
        )
        self._upload_id = None  # completed: nothing left to abort
        # A multipart object's ETag is the MD5 of its parts' MD5s, then "-" and their count:
        # the object is exactly the parts sent (MD5 mode) or whose replies were checked.
        md5s = [md5 for _, md5, _, _ in self._done]
        if any(m is None for m in md5s):  # the MD5s the server answered for the parts
            if not all(_MD5_HEX.match(etag) for _, _, etag, _ in self._done):
                return  # ETags that are no MD5s (SSE-KMS): the store checked the whole CRC32C
            md5s = [bytes.fromhex(etag) for _, _, etag, _ in self._done]
        want = f"{_md5(b''.join(m for m in md5s if m is not None)).hex()}-{len(self._done)}"
        self._check_etag(out, want, "the completed upload", pattern=_MULTIPART_ETAG)

    def _check_etag(
        self, out: Any, want: str, what: str, *, pattern: re.Pattern[str] = _MD5_HEX
    ) -> None:
        """Compare the server's ETag with the MD5 we sent, where it is one."""
        if out.get("ServerSideEncryption") in _OPAQUE_ETAG or out.get("SSECustomerAlgorithm"):
            return  # the ETag is no MD5; Content-MD5 was the check (S3 refused a mismatch)
        got = _etag(out)
        if not pattern.match(got):
            return  # a store whose ETags are something else; Content-MD5 was the check
        if got != want:
            raise IntegrityError(
                f"s3://{self.path}: the server's ETag of {what} is {got!r}, the MD5 of the "
                f"bytes sent is {want!r}: they were changed on the way; the upload is aborted"
            )
