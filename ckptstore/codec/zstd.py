"""Optional zstd compression of payload files (``.zst`` appended to the name).

Checksums in the manifest are of the bytes on disk (the compressed stream), so ``verify``
checks a file without decompressing it.

The writer emits independent standard frames of :data:`FRAME` bytes of content each (with
their content size and a checksum in every frame), compressed on several threads: any zstd
reader reads the concatenation, and ckptstore's reader (:class:`Inflater`) decodes several
frames at once and hands their bytes on in order, holding a few frames, never the file.
Each frame is copied once out of the read buffer, decoded into a buffer that is reused
frame after frame, its checksum checked, and only then handed on (copied into the tensors).
Files of earlier versions are one frame without a content size: they are inflated block by
block, in order, with the same bounds.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import os
import threading
from collections.abc import Callable
from typing import Any

import zstandard

from ..errors import IntegrityError
from ..storage.directio import run_all

__all__ = ["FRAME", "Inflater", "ZstdSink", "decompress"]

#: Level 1: about 1 GB/s a core with ratios of 1.1-1.4 on model weights; more costs time
#: and gains little on floating-point data.
LEVEL = 1
#: Content bytes per frame the writer emits. Frames are independent (a few percent of ratio
#: lost on weights at level 1, whose window is smaller anyway): a reader decodes one per
#: thread, and holds a few of them at a time.
FRAME = 4 << 20
#: Threads that compress or decompress frames (shared by every file of the process).
THREADS = max(1, min(8, os.cpu_count() or 1))

_local = threading.local()


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """The frame workers: they only (de)compress, never wait, so sharing them cannot deadlock."""
    return concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix="ckptstore-zstd")


# A forked child (DataLoader workers) has none of the parent's threads, but the pool's count
# of idle workers came along: its frames were queued for threads that did not exist, and
# every zstd load or save of the child hung (found by review). The child makes its own.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_pool.cache_clear)


def _compress(data: Any, level: int) -> bytes:
    """One independent frame of ``data`` (content size and checksum in it)."""
    cctx = getattr(_local, f"c{level}", None)
    if cctx is None:  # a ZstdCompressor is not thread-safe: one per worker thread
        cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
        setattr(_local, f"c{level}", cctx)
    return bytes(cctx.compress(data))


def _compress_all(pieces: list[Any], level: int) -> list[bytes]:
    """Frames of ``pieces``, in order, compressed on up to :data:`THREADS` threads at once.

    On :func:`~ckptstore.storage.directio.run_all`'s plain threads, where :func:`_pool`
    refuses: an async save still in flight when the interpreter exits is finished by its
    writer thread (``save/staging.py``), and a ``concurrent.futures`` pool takes no new work
    once shutdown has begun: a ``.zst`` save left to finish at exit failed ("cannot schedule
    new futures after interpreter shutdown") and was lost.
    """
    outs: list[Any] = [None] * len(pieces)

    def one(i: int) -> None:
        outs[i] = _compress(pieces[i], level)

    errors = run_all([functools.partial(one, i) for i in range(len(pieces))], THREADS)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return outs


class ZstdSink:
    """A write-only file object compressing into another one; call :meth:`close` to finish.

    Input is cut into frames of :data:`FRAME` bytes, compressed on :data:`THREADS` threads
    and written in order. A ``write`` returns once its frames are written (the caller may
    reuse its buffer), so at most one call's worth of frames is held.
    """

    def __init__(self, raw: Any, *, level: int = LEVEL, frame: int | None = None) -> None:
        self._raw = raw
        self._level = level
        self._frame = frame or FRAME
        self._buf = bytearray()
        self._frames = 0

    def _emit(self, pieces: list[Any]) -> None:
        if len(pieces) == 1:
            outs = [_compress(pieces[0], self._level)]
        else:
            try:
                outs = list(_pool().map(functools.partial(_compress, level=self._level), pieces))
            except RuntimeError:  # the interpreter is exiting: the pool takes no new work
                outs = _compress_all(pieces, self._level)
        for out in outs:
            self._raw.write(out)
        self._frames += len(outs)

    def write(self, data: Any) -> int:
        """Compress ``data`` into the underlying sink (whole frames as they fill)."""
        mv = memoryview(data).cast("B")
        n = len(mv)
        pieces: list[Any] = []
        if self._buf:
            take = min(n, self._frame - len(self._buf))
            self._buf += mv[:take]
            mv = mv[take:]
            if len(self._buf) == self._frame:
                pieces.append(bytes(self._buf))
                self._buf.clear()
        while len(mv) >= self._frame:
            pieces.append(mv[: self._frame])  # no copy: written before this call returns
            mv = mv[self._frame :]
        if pieces:
            self._emit(pieces)
        self._buf += mv
        return n

    def flush(self) -> None:
        """No-op: frames are written as they fill, the last one at :meth:`close`."""

    def writable(self) -> bool:
        """Always true."""
        return True

    def seekable(self) -> bool:
        """Never."""
        return False

    def close(self) -> None:
        """Write the last (short) frame; a stream of nothing is one empty frame."""
        if self._buf or not self._frames:
            self._emit([bytes(self._buf)])
            self._buf.clear()


#: The zstd frame magic, and the range of skippable frames' magics (RFC 8878, 3.1).
_MAGIC = 0xFD2FB528
_SKIPPABLE = 0x184D2A50
#: Most bytes one block regenerates (RFC 8878, 3.1.1.2.4: Block_Maximum_Size).
_BLOCK_MAX = 128 << 10
#: Most bytes one call into the decompressor may produce, when nothing smaller is asked.
_STEP = 64 << 20


def decompress(
    data: bytes | bytearray | memoryview,
    where: str,
    *,
    limit: int | None = None,
    why: str = "",
    declared: Callable[[bytearray], int | None] | None = None,
) -> bytearray:
    """Decompress a whole zstd stream (one frame or more) into a new writable buffer.

    Nothing is inflated past what the content may hold: a stream of a few kilobytes can
    inflate to terabytes (a decompression bomb), and its manifest entry and checksum, of
    the compressed bytes, say nothing about that. The frames' block headers are walked
    first, without decompressing, and blocks are handed to the decompressor only as far as
    the output may still grow, so at most one block (128 KiB) is inflated beyond the limit.

    Args:
        data: the compressed stream (already checked against its manifest entry).
        where: names the file in error messages.
        limit: most bytes the stream may inflate to; None for no bound.
        why: what sets ``limit``, for the message (e.g. "its tensors can take").
        declared: called with the output so far until it returns the size the content
            itself declares (a safetensors header), which then bounds it too; None while
            it needs more bytes (blocks are then inflated one at a time).

    Returns:
        The decompressed bytes.

    Raises:
        IntegrityError: the stream is corrupt, or truncated (a stream reader would return
            the data of an incomplete frame without complaint, so every frame must end), or
            it inflates past ``limit`` or past what ``declared`` returned.
    """
    out = bytearray()
    inflater = Inflater(out.extend, where, limit=limit, why=why, declared=declared)
    inflater.feed(memoryview(data).cast("B"))
    inflater.finish()
    return out


#: Frames that hold less content than this (skippable frames included) are few in a stream
#: ckptstore wrote: its writer's frames are :data:`FRAME` bytes but the last. A stream of
#: more than :data:`_SMALL_FRAMES` of them is refused: a million empty frames of 9 bytes
#: each (a valid stream of the same content) took 52 s to inflate from a 10 MB file, the
#: time going to the frames, not to their content (found by review).
_SMALL = 64 << 10
_SMALL_FRAMES = 16
#: Most content a frame may declare to be decoded whole on a worker; larger frames, and
#: frames that declare no size (files of earlier versions), are inflated block by block.
_WHOLE_MAX = 32 << 20


def _bomb(where: str, cap: int, what: str) -> IntegrityError:
    return IntegrityError(
        f"{where}: zstd stream inflates past the {cap} bytes {what}; refused without "
        "inflating the rest (a corrupt file, or a decompression bomb). Restore an earlier step"
    )


def _decode_frame(frame: memoryview, out: memoryview, where: str, at: int) -> memoryview:
    """Decode one whole frame into ``out``, exactly its declared size (on a worker).

    Into a buffer the caller reuses frame after frame (no fresh pages to fault in); the
    frame's checksum is checked at its end, before this returns, so the caller hands on
    only content that passed it.
    """
    dctx = getattr(_local, "d", None)
    if dctx is None:  # a ZstdDecompressor is not thread-safe: one per worker thread
        dctx = _local.d = zstandard.ZstdDecompressor()
    size = len(out)
    try:
        reader = dctx.stream_reader(frame, read_across_frames=False)
        got = 0
        while got < size:
            n = reader.readinto(out[got:])
            if not n:
                break
            got += n
        # To the frame's end: its checksum is checked there, and no content may follow.
        extra = len(reader.read(1))
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{where}: zstd stream is corrupt ({e}; frame at byte {at})") from None
    if got != size or extra:
        raise IntegrityError(
            f"{where}: zstd stream is corrupt (the frame at byte {at} holds "
            f"{got + extra}{'+' if extra else ''} bytes, its header says {size})"
        )
    return out


class _Slot:
    """A frame's buffers, reused: its compressed bytes and its content."""

    __slots__ = ("content", "packed")

    def __init__(self) -> None:
        self.packed = bytearray()
        self.content = bytearray()


class Inflater:
    """Decompresses a zstd stream pushed in pieces, handing its content on in order.

    ``feed`` it the compressed bytes in order (pieces of any size, already checked against
    the manifest where it has block CRCs), then call ``finish``. Frames that declare their
    content size (every frame ckptstore writes) are collected whole and decoded on
    :data:`THREADS` worker threads, a few ahead of the one being handed on; other frames
    (files of earlier versions) are inflated block by block on the caller's thread.

    Bounds, as :func:`decompress`: nothing is inflated past ``limit`` nor past what
    ``declared`` says the content holds; a frame is refused before it is decoded when its
    declared size would pass them, and a frame's compressed length is bounded by its
    content size. Until ``declared`` has answered, the content is withheld from ``consume``
    (it sees only bytes whose total size is known). A piece fed is parsed where it lies
    (the caller's memory); held here are the bytes of a frame it leaves unfinished, a
    piece of up to :data:`FRAME` bytes that completes it, and the buffers of the frames in
    flight (compressed and decoded, ``window + 1`` pairs, reused): :attr:`peak` records the
    most bytes held at once.

    Args:
        consume: receives the content in order (the view is valid only during the call).
        where: names the file in error messages.
        limit: most bytes the stream may inflate to; None for no bound.
        why: what sets ``limit``, for the message.
        declared: called with the content so far until it returns the size the content
            itself declares (a safetensors header); None while it needs more bytes.
        window: frames decoded ahead of the one handed on (default :data:`THREADS` + 1).
    """

    def __init__(
        self,
        consume: Callable[[memoryview], None],
        where: str,
        *,
        limit: int | None = None,
        why: str = "",
        declared: Callable[[bytearray], int | None] | None = None,
        window: int | None = None,
    ) -> None:
        self._consume = consume
        self.where = where
        self._caps: list[tuple[int, str]] = [(limit, why)] if limit is not None else []
        self._declared = declared
        self._head: bytearray | None = bytearray() if declared is not None else None
        #: The size the content declared (None until ``declared`` answered).
        self.declared_size: int | None = None
        self._window = window if window is not None else THREADS + 1
        self._jobs: collections.deque[tuple[concurrent.futures.Future[memoryview], _Slot]] = (
            collections.deque()
        )
        self._free: list[_Slot] = []  # buffers of frames handed on, for the next ones
        self._promised = 0  # content delivered plus that of the frames in flight
        self._slots = 0  # bytes of the frames' buffers (in flight or free for reuse)
        #: Content bytes handed to ``consume`` (or withheld while the size is unknown).
        self.out = 0
        #: Compressed bytes fed.
        self.fed = 0
        #: The most bytes held at once: unparsed input, frames in flight, withheld head.
        self.peak = 0
        self._pend: bytearray | memoryview = bytearray()
        self._base = 0  # stream offset of _pend[0]
        self._pos = 0  # next unparsed byte of _pend
        self._mode = "start"
        self._skip = 0
        self._fstart = 0  # first byte of the current frame not yet decoded
        self._frame_at = 0
        self._q = 0  # next block header of the current frame
        self._last = False
        self._has_ck = False
        self._size = 0
        self._max_len = 0
        self._dobj: Any = None
        self._small = 0  # frames of under _SMALL bytes of content so far
        self._seq_out = 0  # content before the frame being inflated block by block

    # ---- bookkeeping -----------------------------------------------------------------

    def _held(self) -> None:
        head = len(self._head) if self._head is not None else 0
        # A borrowed view of the piece being fed is the caller's memory, not held here.
        pend = len(self._pend) if isinstance(self._pend, bytearray) else 0
        self.peak = max(self.peak, pend + self._slots + head)

    def _truncated(self) -> IntegrityError:
        return IntegrityError(f"{self.where}: zstd stream is truncated (its last frame never ends)")

    def _corrupt(self, what: str) -> IntegrityError:
        return IntegrityError(f"{self.where}: zstd stream is corrupt ({what})")

    def _count_small(self, at: int) -> None:
        """One more frame of under :data:`_SMALL` bytes of content (at stream byte ``at``)."""
        self._small += 1
        if self._small > _SMALL_FRAMES:
            raise self._corrupt(
                f"{self._small} frames of under {_SMALL >> 10} KiB by byte {at}, where "
                "ckptstore writes one, the last"
            )

    def _room(self) -> int:
        if self._head is not None:
            return 1  # one block at a time until the content has declared its size
        return min((cap + 1 - self.out for cap, _ in self._caps), default=_STEP)

    def _deliver(self, piece: bytes | bytearray | memoryview) -> None:
        n = len(piece)
        if not n:
            return
        if self._head is not None:
            assert self._declared is not None
            self._head += piece
            self._held()
            size = self._declared(self._head)
            if size is None:
                for cap, what in self._caps:
                    if len(self._head) > cap:
                        raise _bomb(self.where, cap, what)
                self.out += n
                return
            for cap, what in self._caps:
                if size > cap:  # refused before the header is handed on (and allocated for)
                    raise _bomb(self.where, cap, what)
            self.declared_size = size
            self._caps.append((size, "its own header declares"))
            head, self._head = self._head, None
            self.out -= len(head) - n
            self._deliver(head)
            return
        for cap, what in self._caps:
            if self.out + n > cap:
                raise _bomb(self.where, cap, what)
        self._consume(memoryview(piece))
        self.out += n

    def _drain(self, keep: int) -> None:
        while len(self._jobs) > keep:
            fut, slot = self._jobs.popleft()
            piece = fut.result()
            try:
                self._deliver(piece)
            finally:
                piece.release()
            self._free.append(slot)

    # ---- parsing ---------------------------------------------------------------------

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Take the next compressed bytes; decode and hand on whatever they complete.

        The piece is parsed where it lies: each whole frame in it is copied once, into a
        buffer its decoder thread reads, and only the bytes of a frame it leaves
        unfinished are kept (copied) for the next piece.
        """
        mv = memoryview(data).cast("B")
        self.fed += len(mv)
        i = 0
        try:
            while i < len(mv):
                if not self._pend:  # nothing waits: parse the rest of the piece in place
                    self._pend = mv[i:]
                    i = len(mv)
                    self._run(final=False)
                    continue
                # A frame begun in an earlier piece: completed a frame's worth at a time,
                # so that what waits unparsed stays near one frame.
                j = min(len(mv), i + FRAME)
                assert isinstance(self._pend, bytearray)
                self._pend += mv[i:j]
                self._held()
                self._run(final=False)
                left = len(self._pend)
                if left <= j - i:  # what waits lies in this piece: parse on from there
                    self._pend = bytearray()
                    j -= left
                i = j
        except BaseException:
            self._pend = bytearray()  # the stream failed: nothing of it is kept
            raise
        if not isinstance(self._pend, bytearray):  # never keep a view of the caller's
            self._pend = bytearray(self._pend)
            self._held()

    def finish(self) -> int:
        """End of the stream: decode the rest; returns the content's size.

        Raises:
            IntegrityError: the stream is corrupt, truncated, or inflates past its bounds.
        """
        if not self.fed:
            raise self._truncated()
        self._run(final=True)
        if self._mode != "start":
            raise self._truncated()
        self._drain(0)
        if self._head is not None:  # the content never declared its size: hand it on as is
            head, self._head = self._head, None
            if head:
                self._consume(memoryview(head))
        return self.out

    def close(self) -> None:
        """Drop frames in flight (after an error)."""
        for fut, _ in self._jobs:
            fut.cancel()
        self._jobs.clear()
        self._free.clear()

    def _run(self, *, final: bool) -> None:
        try:
            while self._advance(final):
                pass
        except BaseException:
            self.close()
            raise
        keep = self._fstart if self._mode in ("whole", "seq") else self._pos
        if keep:
            if isinstance(self._pend, bytearray):
                del self._pend[:keep]
            else:
                self._pend = self._pend[keep:]
            self._base += keep
            self._pos -= keep
            self._q -= keep
            self._fstart -= keep

    def _need(self, final: bool) -> bool:
        if final:
            raise self._truncated()
        return False

    def _advance(self, final: bool) -> bool:
        """One step of the parser; False when it needs more bytes."""
        pend = self._pend
        avail = len(pend) - self._pos
        if self._mode == "skip":
            take = min(self._skip, avail)
            self._pos += take
            self._skip -= take
            if self._skip:
                return self._need(final)
            self._mode = "start"
            return True
        if self._mode == "whole":
            return self._walk_whole(final)
        if self._mode == "seq":
            return self._walk_seq(final)
        # At a frame boundary.
        if avail == 0:
            return False
        pos = self._pos
        if avail < 8 and _MAGIC.to_bytes(4, "little").startswith(bytes(pend[pos : pos + 4])):
            if avail < 5:
                return self._need(final)
        elif avail < 4:
            if final:
                raise self._corrupt(f"no zstd frame at byte {self._base + pos}")
            return False
        magic = int.from_bytes(pend[pos : pos + 4], "little")
        if magic & 0xFFFFFFF0 == _SKIPPABLE:  # user data that decoders skip
            if avail < 8:
                return self._need(final)
            self._count_small(self._base + pos)
            self._skip = int.from_bytes(pend[pos + 4 : pos + 8], "little")
            self._pos += 8
            self._mode = "skip"
            return True
        if magic != _MAGIC:
            raise self._corrupt(
                f"no zstd frame at byte {self._base + pos}: bad magic {magic:#010x}"
            )
        fhd = pend[pos + 4]
        if fhd & 0x08:
            raise self._corrupt(f"reserved bit set in the frame header at byte {self._base + pos}")
        single = bool(fhd & 0x20)
        fcs_len = (1 if single else 0, 2, 4, 8)[fhd >> 6]
        hlen = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 0x03] + fcs_len
        if avail < hlen:
            return self._need(final)
        size = None
        if fcs_len:
            size = int.from_bytes(pend[pos + hlen - fcs_len : pos + hlen], "little")
            size += 256 if fcs_len == 2 else 0
        self._fstart = pos
        self._frame_at = self._base + pos
        self._q = pos + hlen
        self._last = False
        self._has_ck = bool(fhd & 0x04)
        if size is not None and size < _SMALL:
            self._count_small(self._frame_at)
        if size is not None and size <= _WHOLE_MAX:
            for cap, what in self._caps:  # refused before a byte of it is inflated
                if self._promised + size > cap:
                    raise _bomb(self.where, cap, what)
            self._size = size
            # Every block regenerates up to 128 KiB: a frame's compressed bytes cannot
            # outgrow its content by more than a block header per block, plus the header
            # and checksum. A frame of empty blocks that never ends is refused by this.
            self._max_len = hlen + size + 3 * (size // _BLOCK_MAX + 2) + 4
            self._mode = "whole"
        else:
            self._drain(0)  # in order: frames in flight come first
            self._dobj = zstandard.ZstdDecompressor().decompressobj()
            self._seq_out = self.out
            self._mode = "seq"
        return True

    def _block(self, q: int) -> tuple[int, bool, int]:
        """The block header at ``q``: (end of the block, last?, most bytes it regenerates)."""
        head = int.from_bytes(self._pend[q : q + 3], "little")
        kind, size = (head >> 1) & 3, head >> 3
        if kind == 3:
            raise self._corrupt(f"reserved block type at byte {self._base + q}")
        end = q + 3 + (1 if kind == 1 else size)
        return end, bool(head & 1), (_BLOCK_MAX if kind == 2 else size)

    def _walk_whole(self, final: bool) -> bool:
        pend = self._pend
        while not self._last:
            if self._q + 3 > len(pend):
                return self._need(final)
            self._q, self._last, _ = self._block(self._q)
            if self._q - self._fstart > self._max_len:
                raise self._corrupt(
                    f"the frame at byte {self._frame_at} is longer than its "
                    f"{self._size} bytes of content can take"
                )
        end = self._q + (4 if self._has_ck else 0)
        if end > len(pend):
            return self._need(final)
        n = end - self._fstart
        slot = self._free.pop() if self._free else _Slot()
        if len(slot.packed) < n:  # replaced, never resized: a view of it may be alive
            self._slots += n - len(slot.packed)
            slot.packed = bytearray(n)
        if len(slot.content) < self._size:
            self._slots += self._size - len(slot.content)
            slot.content = bytearray(self._size)
        slot.packed[:n] = pend[self._fstart : end]
        fut = _pool().submit(
            _decode_frame,
            memoryview(slot.packed)[:n],
            memoryview(slot.content)[: self._size],
            self.where,
            self._frame_at,
        )
        self._jobs.append((fut, slot))
        self._promised += self._size
        self._pos = self._fstart = end
        self._mode = "start"
        self._held()
        # Until the content has declared its size, one frame at a time: the next is only
        # decoded once the size it may take is known.
        self._drain(0 if self._head is not None else self._window)
        return True

    def _walk_seq(self, final: bool) -> bool:
        pend = self._pend
        mv = memoryview(pend)
        try:
            if self._last:
                end = self._q + (4 if self._has_ck else 0)
                if end > len(pend):
                    return self._need(final)
                piece = self._inflate(mv[self._fstart : end])
                if not self._dobj.eof or self._dobj.unused_data:
                    raise self._corrupt(
                        f"the frame at byte {self._frame_at} does not end where its last block does"
                    )
                self._pos = self._fstart = end
                self._mode = "start"
                self._deliver(piece)
                self._promised = self.out
                if self.out - self._seq_out < _SMALL:
                    self._count_small(self._frame_at)
                return True
            # Hand over whole blocks, as many as the output may still grow by (at least
            # one): raw and RLE blocks say how much they regenerate, a compressed block at
            # most 128 KiB.
            budget = max(1, min(self._room(), _STEP))
            bound = 0
            q = self._q
            while not self._last and (bound < budget or q == self._fstart):
                if q + 3 > len(pend):
                    break
                end, last, regen = self._block(q)
                if end > len(pend):
                    break
                q, self._last, bound = end, last, bound + regen
            if q == self._q:
                return self._need(final)
            self._q = q
            if self._last:
                return True  # the checksum and the last blocks go together
            piece = self._inflate(mv[self._fstart : q])
            self._fstart = q
            self._deliver(piece)
            self._promised = self.out
            return True
        finally:
            mv.release()

    def _inflate(self, data: memoryview) -> bytes:
        try:
            return bytes(self._dobj.decompress(data))
        except zstandard.ZstdError as e:
            raise self._corrupt(str(e)) from None
