"""Streaming a stored ``torch.save`` zip: decoded or checked as its bytes go by.

Restores stream the archive (:class:`StreamDecoder`): ``torch.save`` stores every member
uncompressed, so each tensor's storage is a byte range of the file. The central directory
(at the end) is read and checked first, bounded; then the file streams front to back, block
by block checked: ``data.pkl`` (written first) is unpickled by torch's ``weights_only``
unpickler with storages on the ``meta`` device (no memory), which says which storage each
tensor views, and every storage's bytes go straight from the read buffers into the target
tensor, or a fresh one. Every member's CRC-32 runs along the bytes as they are copied and
must match the central directory's before the member is used (``data.pkl`` unpickled, a
tensor handed out); ``torch.load`` never checks them. An archive not laid out so is read
whole, its CRC-32s checked, and given to ``torch.load``.

The content of a compressed payload has no central directory to read first:
:class:`SequentialDecoder` follows it front to back and checks the directory last, and
:class:`~.zipcheck.ZipStreamChecker` checks it (``verify``) without torch; the records of
the format are in :mod:`.ziprecords`. The whole-archive functions (write, load,
:func:`~ckptstore.codec.torchzip.check_zip`) are in :mod:`ckptstore.codec.torchzip`.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import zipfile
import zlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import IntegrityError, UnsafeCheckpointError
from ..integrity import BLOCK, check_blocks
from .torchzip import _compressed
from .zipcheck import ZipStreamChecker
from .ziprecords import (
    _CDH,
    _DD,
    _EOCD,
    _LFH,
    _MAX_MEMBERS,
    _MAX_SCANNED,
    _TAIL,
    MAX_DIRECTORY_BYTES,
    MAX_RECORD_BYTES,
    NotStreamable,
    _bad,
    _has_zip64,
    _held_directory,
    _lfh_lengths,
    _Member,
    _zip64_extra,
    parse_directory,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAX_DIRECTORY_BYTES",
    "MAX_RECORD_BYTES",
    "NotStreamable",
    "SequentialDecoder",
    "StreamDecoder",
    "ZipStreamChecker",
    "open_stream",
    "parse_directory",
]


# ---- streaming restore ------------------------------------------------------------------


class StreamDecoder:
    """Decodes a stored ``torch.save`` zip from the slices of a checked stream.

    Build it with :func:`open_stream` (a file of a store) or :meth:`from_buffer`; feed it
    ``(offset, slice)`` in file order (``Storage.stream_file`` passes checked blocks only);
    :meth:`result` gives the tensors. Each storage is copied once, from the slice into a
    tensor of ``into`` (same dtype and shape, contiguous, CPU, the storage's only tensor) or
    a fresh one, its CRC-32 computed along the copy and compared with the central
    directory's when the member ends (an ``IntegrityError`` naming the member otherwise).
    """

    def __init__(
        self, members: list[_Member], where: str, into: Mapping[str, torch.Tensor] | None
    ) -> None:
        self.where = where
        self.into = dict(into or {})
        self.members = members
        self._i = 0
        self._pickle: _Member | None = None
        self._prefix = ""
        for m in members:
            if m.name.endswith("data.pkl") and m.name.count("/") == 1:
                if self._pickle is not None:
                    raise _bad(where, "two data.pkl members")
                self._pickle = m
                self._prefix = m.name[: -len("data.pkl")]
        if self._pickle is None:
            raise IntegrityError(f"{where}: zip archive has no data.pkl; not a torch.save file")
        self._by_name = {m.name: m for m in members}
        if len(self._by_name) != len(members):
            raise _bad(where, "two members with one name")
        self._storages: dict[str, tuple[Any, int]] = {}  # key -> (uint8 tensor, nbytes)
        self._result: dict[str, torch.Tensor] | None = None
        self._views: list[tuple[str, str, Any]] = []  # name, key, meta tensor
        self._filled: set[str] = set()  # storages whose member was found
        self.reused = 0
        self._crc = 0  # the CRC-32 of the current member's bytes so far
        #: What data.pkl's storages may take in all, where the members' sizes are not
        #: known before it (``SequentialDecoder``); here each is checked against its member.
        self.limit: int | None = None
        self._known = True

    @classmethod
    def from_buffer(
        cls,
        data: bytes | bytearray | memoryview,
        where: str,
        into: Mapping[str, torch.Tensor] | None,
    ) -> StreamDecoder | None:
        """A decoder of a whole (checked) archive in memory; None: use ``torch.load``."""
        mv = memoryview(data).cast("B")
        seen = _Seen(len(mv), lambda o, n: mv[o : o + n])
        try:
            return cls(seen.agree(parse_directory(len(mv), seen.fetch, where)), where, into)
        except NotStreamable:
            return None

    def __call__(self, offset: int, chunk: memoryview) -> None:
        """Consume the bytes ``chunk`` found at ``offset`` of the file."""
        end = offset + len(chunk)
        pos = offset
        while self._i < len(self.members) and pos < end:
            m = self.members[self._i]
            if m.data_start < 0:  # its local header
                pos = max(pos, m.lho + len(m.head))
                if pos >= end:
                    return
                need = 30 if len(m.head) < 30 else 30 + _lfh_lengths(m.head)
                take = min(end, m.lho + need) - pos
                m.head += chunk[pos - offset : pos - offset + take]
                pos += take
                if len(m.head) >= 30:
                    if struct.unpack("<I", m.head[:4])[0] != _LFH:
                        raise _bad(self.where, f"no local header for member {m.name!r}")
                    if len(m.head) == 30 + _lfh_lengths(m.head):
                        self._start(m)
                continue
            stop = m.data_start + m.size
            a, b = max(pos, m.data_start), min(end, stop)
            if a < b:
                piece = chunk[a - offset : b - offset]
                if m.dest is not None:
                    m.dest[a - m.data_start : b - m.data_start] = piece
                self._crc = zlib.crc32(piece, self._crc)
            pos = max(pos, b)
            if b == stop or m.size == 0:
                self._finish(m)
                self._i += 1

    def _start(self, m: _Member) -> None:
        nlen = struct.unpack("<H", m.head[26:28])[0]
        if m.head[30 : 30 + nlen].decode("utf-8", "replace") != m.name:
            raise _bad(self.where, f"local header of {m.name!r} names another member")
        m.data_start = m.lho + len(m.head)
        nxt = self._i + 1
        limit = self.members[nxt].lho if nxt < len(self.members) else math.inf
        if m.data_start + m.size > limit:
            raise _bad(self.where, f"member {m.name!r} overlaps the next one")
        m.head = bytearray()
        m.dest = self._dest(m)
        self._crc = 0

    def _dest(self, m: _Member) -> memoryview | None:
        rel = m.name[len(self._prefix) :] if m.name.startswith(self._prefix) else None
        if rel is not None and rel.startswith("data/") and m is not self._pickle:
            if self._result is None:
                raise NotStreamable  # a storage before data.pkl: not torch.save's order
            got = self._storages.get(rel[5:])
            if got is None:
                return None  # a storage no tensor uses
            buf, nbytes = got
            self._filled.add(rel[5:])
            self._same_size(rel, m.size, nbytes)
            return _bytes_of(buf)
        if m.size > MAX_RECORD_BYTES:
            raise _bad(self.where, f"record {m.name!r} of {m.size} bytes is too large")
        return memoryview(bytearray(m.size))

    def _finish(self, m: _Member) -> None:
        if self._crc != m.crc:  # before anything of it is used
            raise IntegrityError(f"{self.where}: zip member {m.name!r} fails its CRC-32 check")
        rel = m.name[len(self._prefix) :]
        if m is self._pickle:
            assert m.dest is not None
            self._unpickle(m.dest)
        elif rel == "byteorder" and m.dest is not None and bytes(m.dest) != b"little":
            raise NotStreamable  # big-endian storages: torch.load swaps them
        m.dest = None

    def _unpickle(self, data: memoryview) -> None:
        import torch
        from torch import _weights_only_unpickler as wo

        metas: dict[int, str] = {}
        sizes: dict[str, tuple[Any, int]] = {}

        def persistent_load(pid: Any) -> Any:
            if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] not in ("storage", b"storage"):
                raise _bad(self.where, f"unexpected persistent id in data.pkl: {pid!r}")
            _, stype, key, _, numel = pid
            dtype = torch.uint8 if stype is torch.UntypedStorage else getattr(stype, "dtype", None)
            if not isinstance(dtype, torch.dtype) or not isinstance(numel, int) or numel < 0:
                raise _bad(self.where, f"unexpected storage in data.pkl: {pid!r}")
            nbytes = numel * dtype.itemsize
            key = str(key)
            if key in sizes and sizes[key][1] != nbytes:
                raise _bad(self.where, f"storage {key!r} has two sizes in data.pkl")
            sizes[key] = (dtype, nbytes)
            meta = torch.UntypedStorage(nbytes, device="meta")  # type: ignore[no-untyped-call]
            metas[meta._cdata] = key
            return torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
                wrap_storage=meta, dtype=dtype, _internal=True
            )

        try:
            up = wo.Unpickler(io.BytesIO(bytes(data)), encoding="utf-8")
            up.persistent_load = persistent_load  # type: ignore[method-assign]
            obj = up.load()  # type: ignore[no-untyped-call]
        except IntegrityError:
            raise
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"{self.where}: refused to load: the pickle inside asks for more than tensors "
                f"and plain data ({e}). ckptstore never falls back to weights_only=False"
            ) from None
        except Exception as e:  # anything else the unpickler raises: corrupt
            raise IntegrityError(f"{self.where}: data.pkl unreadable: {e}") from None
        if not isinstance(obj, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
        ):
            raise IntegrityError(f"{self.where}: payload is not a flat dict of tensors")
        self._check_sizes(sizes)
        users: dict[str, int] = {}
        for t in obj.values():
            key = metas.get(t.untyped_storage()._cdata)
            if key is None:
                raise _bad(self.where, "a tensor of data.pkl has no storage in the archive")
            users[key] = users.get(key, 0) + 1
        result: dict[str, torch.Tensor] = {}
        for name, t in obj.items():
            key = metas[t.untyped_storage()._cdata]
            dtype, nbytes = sizes[key]
            whole = (
                users[key] == 1
                and t.storage_offset() == 0
                and t.is_contiguous()
                and t.numel() * t.element_size() == nbytes
                and t.dtype == dtype
            )
            if whole:
                target = self.into.get(name)
                if (
                    target is not None
                    and target.dtype == t.dtype
                    and target.shape == t.shape
                    and target.device.type == "cpu"
                    and target.is_contiguous()
                ):
                    self.reused += 1
                    dest = target
                else:
                    dest = torch.empty(t.shape, dtype=t.dtype)
                self._storages[key] = (dest, nbytes)
                result[name] = dest
            else:  # a view or a shared storage: the storage once, the tensors view it
                if key not in self._storages:
                    self._storages[key] = (torch.empty(nbytes, dtype=torch.uint8), nbytes)
                self._views.append((name, key, t))
        self._result = result

    def _same_size(self, rel: str, size: int, nbytes: int) -> None:
        """Refuse a storage whose member does not hold what data.pkl says it does.

        Checked when the member starts, or before any allocation where the directory came
        first (:meth:`_check_sizes`).
        """
        if size != nbytes:
            raise _bad(self.where, f"storage {rel!r} holds {size} bytes, data.pkl says {nbytes}")

    def _check_sizes(self, sizes: Mapping[str, tuple[Any, int]]) -> None:
        """Refuse storages data.pkl declares larger than the archive holds, before any alloc.

        Each against its member where the directory is known, all of them against
        ``limit`` otherwise: a forged data.pkl declaring 2**43 floats made the allocator
        raise, and no restore fell back.
        """
        if self._known:
            for key, (_, nbytes) in sizes.items():
                m = self._by_name.get(f"{self._prefix}data/{key}")
                if m is not None:
                    self._same_size(f"data/{key}", m.size, nbytes)
            return
        total = sum(nbytes for _, nbytes in sizes.values())
        if self.limit is not None and total > self.limit:
            raise IntegrityError(
                f"{self.where}: data.pkl declares storages of {total} bytes, past the "
                f"{self.limit} bytes its tensors in the state file can take; the file is "
                "corrupt or hostile. Restore an earlier step"
            )

    def result(self) -> dict[str, torch.Tensor]:
        """The decoded tensors (call once the stream was checked to its end)."""
        import torch

        if self._result is None or self._i < len(self.members):
            raise _bad(self.where, "the stream ended before the archive did")
        missing = set(self._storages) - self._filled
        if missing:
            raise _bad(self.where, f"storages {sorted(missing)[:5]} of data.pkl are not in it")
        out = dict(self._result)
        for name, key, meta in self._views:
            buf = self._storages[key][0]
            typed = buf.view(meta.dtype)
            try:
                out[name] = torch.as_strided(
                    typed, meta.shape, meta.stride(), meta.storage_offset()
                )
            except RuntimeError as e:
                raise _bad(self.where, f"tensor {name!r} does not fit its storage ({e})") from None
        return out


def _bytes_of(t: Any) -> memoryview:
    from .safetensors import tensor_bytes

    return tensor_bytes(t)


def open_stream(
    storage: Any, step: int, name: str, entry: Any, into: Mapping[str, torch.Tensor] | None
) -> StreamDecoder | None:
    """A decoder for a ``.pt`` payload of a store, its central directory read and checked.

    The directory's blocks are read (a few, at the end of the file) and checked against
    ``entry.blocks`` before anything in them is used. Returns ``None`` for an archive not
    laid out as ``torch.save`` writes it, or a file without block CRCs: read it whole.
    """
    if entry.blocks is None:
        return None
    where = storage.describe(step, name)
    with storage.range_reader(step, {name: entry}) as rr:

        def read(offset: int, length: int) -> memoryview:
            lo = offset - offset % BLOCK
            hi = min(entry.bytes, -(-(offset + length) // BLOCK) * BLOCK)
            buf = rr.read(name, lo, hi - lo)
            check_blocks(entry, lo, buf, where)
            return memoryview(buf)[offset - lo : offset - lo + length]

        seen = _Seen(entry.bytes, read)
        try:
            return StreamDecoder(
                seen.agree(parse_directory(entry.bytes, seen.fetch, where)), where, into
            )
        except NotStreamable:
            return None


class _Seen(io.RawIOBase):
    """What :func:`parse_directory` read of an archive (its tail, its directory), as a file.

    ``verify`` reads an uncompressed archive's directory with ``zipfile``
    (:func:`~.torchzip.check_zip`), whose rules for the end records differ from
    :func:`parse_directory`'s on hostile files: which end record counts, where the
    directory must end, a zip64 locator's disk fields. ``zipfile`` opens these same bytes
    (it reads nothing else of a ``torch.save`` archive) and must list the same members,
    offsets, sizes and CRC-32s; otherwise the archive is read whole, where ``check_zip``
    speaks, so restore and verify agree. No byte of the file is read twice for this.
    """

    def __init__(self, size: int, read: Callable[[int, int], memoryview]) -> None:
        super().__init__()
        self.size = size
        self._read = read
        self._pieces: list[tuple[int, memoryview]] = []
        self._pos = 0

    def fetch(self, offset: int, length: int) -> memoryview:
        """``read(offset, length)``, kept for ``zipfile``: the ``read`` of the parse."""
        got = self._read(offset, length)
        self._pieces.append((offset, got))
        return got

    def agree(self, members: list[_Member]) -> list[_Member]:
        """``members``, or :class:`NotStreamable` where ``zipfile`` reads another directory."""
        try:
            with zipfile.ZipFile(self) as zf:
                infos = zf.infolist()
        except Exception:  # zipfile refuses it: check_zip says why, reading it whole
            raise NotStreamable from None
        theirs = sorted((i.header_offset, i.filename, i.file_size, i.CRC) for i in infos)
        if theirs != [(m.lho, m.name, m.size, m.crc) for m in members]:
            raise NotStreamable
        return members

    def readable(self) -> bool:
        """Always true."""
        return True

    def seekable(self) -> bool:
        """Always true."""
        return True

    def tell(self) -> int:
        """The current position."""
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move the position like a file does."""
        pos = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence] + offset
        if pos < 0:
            raise OSError("seek before the start of the file")
        self._pos = pos
        return pos

    def readinto(self, b: Any) -> int:
        """The next bytes, from what was read; ``OSError`` for bytes that were not."""
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), self.size - self._pos))
        if not n:
            return 0
        for at, got in self._pieces:
            if at <= self._pos and self._pos + n <= at + len(got):
                out[:n] = got[self._pos - at : self._pos - at + n]
                self._pos += n
                return n
        raise OSError("bytes of the archive that its directory's parse did not read")


# ---- streaming a compressed archive: no central directory first -------------------------


class SequentialDecoder(StreamDecoder):
    """Decodes a stored ``torch.save`` zip front to back, from its content alone.

    For an archive whose central directory cannot be read first (the content of a zstd
    stream, inflating in order). ``torch.save`` writes each member's sizes only after its
    data, in a data descriptor; so a storage's size comes from ``data.pkl`` (written
    first, and unpickled as soon as it is in) and goes straight into its tensor, while a
    small record (``data.pkl``, ``byteorder``, ...) is held until its descriptor is found
    (bounded by :data:`MAX_RECORD_BYTES`; the descriptor must give the bytes before it and
    their CRC-32). Every member's CRC-32 runs along its bytes and must match its local
    header's or descriptor's when it ends. The central directory at the end (bounded by
    :data:`MAX_DIRECTORY_BYTES`) must then list exactly the members followed, with those
    CRC-32s, or the archive is refused. Held at once: one record, the directory, and the
    last 64 KiB.

    Raises (from ``__call__`` and :meth:`result`):
        IntegrityError: the archive is malformed or its directory disagrees.
        NotStreamable: valid, perhaps, but not laid out as ``torch.save`` writes it: read
            the file whole.
    """

    def __init__(
        self, where: str, into: Mapping[str, torch.Tensor] | None, limit: int | None = None
    ) -> None:
        # Members are found as they stream by: none is known yet.
        self.limit = limit
        self._known = False
        self.where = where
        self.into = dict(into or {})
        self.members = []
        self._i = 0
        self._pickle = None
        self._prefix = ""
        self._by_name = {}
        self._storages = {}
        self._result = None
        self._views = []
        self._filled = set()
        self.reused = 0
        self._crc = 0  # the CRC-32 of the current member's bytes so far
        self._want_crc = 0  # the CRC-32 the current member's local header gives
        self._pos = 0  # content bytes consumed
        self._state = "head"
        self._cur: _Member | None = None
        self._buf = bytearray()  # a header, a record, a descriptor or the directory
        self._left = 0  # data bytes of the current member still to come
        self._sized = True  # the current member's size is in its local header
        self._zip64 = False
        self._scan_from = 0
        self._recent = bytearray()  # the last _TAIL bytes before the directory
        self._tail_base = -1  # content offset of _buf[0] once in the directory
        #: The most bytes held at once (records, directory, the recent window).
        self.peak = 0

    def __call__(self, offset: int, chunk: memoryview) -> None:
        """Consume the next ``chunk`` of the content, found at ``offset`` (in order)."""
        if offset != self._pos:
            raise ValueError(f"bytes at {offset} fed after {self._pos}: feed in order")
        mv = memoryview(chunk).cast("B")
        at = offset
        while len(mv):
            used = self._step(at, mv)
            at += used
            mv = mv[used:]
        self._pos = at
        self.peak = max(self.peak, len(self._buf) + len(self._recent))

    def _remember(self, b: memoryview) -> None:
        """Keep the last bytes before the directory: its end record is searched there."""
        if len(b) >= _TAIL:
            self._recent[:] = b[-_TAIL:]
        else:
            self._recent += b
            if len(self._recent) > 2 * _TAIL:
                del self._recent[:-_TAIL]

    def _step(self, at: int, mv: memoryview) -> int:
        """Consume a prefix of ``mv`` (at content offset ``at``); returns its length."""
        state = self._state
        if state == "dir":
            self._buf += mv
            if len(self._buf) > MAX_DIRECTORY_BYTES + 2 * _TAIL:
                raise _bad(self.where, "central directory over its bound")
            return len(mv)
        if state == "head":
            return self._header(at, mv)
        if state == "data":
            m = self._cur
            assert m is not None
            n = min(self._left, len(mv))
            if m.dest is not None:
                done = m.size - self._left
                m.dest[done : done + n] = mv[:n]
            self._crc = zlib.crc32(mv[:n], self._crc)
            self._left -= n
            self._remember(mv[:n])
            if not self._left:
                self._data_done(m)
            return n
        n = self._descriptor(mv) if state == "desc" else self._scan(mv)
        self._remember(mv[:n])
        return n

    def _header(self, at: int, mv: memoryview) -> int:
        buf = self._buf
        need = 30 if len(buf) < 30 else 30 + _lfh_lengths(buf)
        take = min(need - len(buf), len(mv))
        buf += mv[:take]
        self._remember(mv[:take])
        if len(buf) >= 4:
            sig = struct.unpack("<I", buf[:4])[0]
            if sig in (_CDH, _EOCD):  # the directory: held from here on, after the window
                self._buf = bytearray(self._recent)
                self._tail_base = at + take - len(self._recent)
                self._recent = bytearray()
                self._state = "dir"
                return take
            if sig != _LFH:
                raise _bad(self.where, f"no local header at byte {at + take - len(buf)}")
        if len(buf) < 30 or len(buf) < 30 + _lfh_lengths(buf):
            return take
        self._open_member(at + take - len(buf), bytes(buf))
        buf.clear()
        return take

    def _open_member(self, lho: int, head: bytes) -> None:
        (flags, method, _, _, crc, csize, usize, nlen, xlen) = struct.unpack(
            "<HHHHIIIHH", head[6:30]
        )
        name = head[30 : 30 + nlen].decode("utf-8", "replace")
        extra = head[30 + nlen : 30 + nlen + xlen]
        if method != 0:
            raise _compressed(self.where, name, method, csize, usize)
        if flags & 1:
            raise _bad(self.where, f"member {name!r} is encrypted")
        if name in self._by_name:
            raise _bad(self.where, "two members with one name")
        if len(self.members) >= _MAX_MEMBERS:
            raise _bad(self.where, f"more than {_MAX_MEMBERS} members")
        m = _Member(name, lho, 0)
        m.data_start = lho + len(head)
        self._zip64 = _has_zip64(extra)
        if not self.members:  # torch.save writes data.pkl first
            if not (name.endswith("data.pkl") and name.count("/") == 1):
                raise NotStreamable
            self._pickle = m
            self._prefix = name[: -len("data.pkl")]
        self.members.append(m)
        self._by_name[name] = m
        self._cur = m
        self._sized = not flags & 8
        self._want_crc = crc
        if self._sized:
            if self._zip64:
                usize, csize = _zip64_extra(extra, 2, self.where)
            if csize != usize:
                raise _bad(
                    self.where, f"member {name!r} is stored in {csize} bytes but holds {usize}"
                )
            self._begin_data(m, usize)
            return
        rel = name[len(self._prefix) :] if name.startswith(self._prefix) else ""
        if rel.startswith("data/") and m is not self._pickle:
            if self._result is None:
                raise NotStreamable  # a storage before data.pkl: not torch.save's order
            got = self._storages.get(rel[5:])
            if got is None:
                raise NotStreamable  # a storage no tensor uses: its size is nowhere
            self._begin_data(m, got[1])
            return
        self._state = "scan"
        self._scan_from = 0

    def _begin_data(self, m: _Member, size: int) -> None:
        m.size = size
        m.dest = self._dest(m)
        self._crc = 0
        self._left = size
        self._state = "data"
        if not size:
            self._data_done(m)

    def _data_done(self, m: _Member) -> None:
        if self._sized:
            m.crc = self._want_crc  # checked against the bytes by _finish
            self._member_done(m)
        else:
            self._state = "desc"

    def _member_done(self, m: _Member) -> None:
        self._finish(m)
        self._i = len(self.members)
        self._cur = None
        self._state = "head"

    def _desc_len(self) -> int:
        return 24 if self._zip64 else 16

    def _desc_sizes(self, d: bytes | bytearray | memoryview) -> tuple[int, int, int, int]:
        sig, crc = struct.unpack("<II", d[:8])
        fmt = "<QQ" if self._zip64 else "<II"
        csize, usize = struct.unpack(fmt, d[8 : self._desc_len()])
        return sig, crc, csize, usize

    def _descriptor(self, mv: memoryview) -> int:
        m = self._cur
        assert m is not None
        take = min(self._desc_len() - len(self._buf), len(mv))
        self._buf += mv[:take]
        if len(self._buf) == self._desc_len():
            sig, crc, csize, usize = self._desc_sizes(self._buf)
            if sig != _DD:
                raise NotStreamable  # a descriptor without its signature
            if csize != m.size or usize != m.size:
                raise _bad(self.where, f"member {m.name!r}: its descriptor says {usize} bytes")
            m.crc = crc  # checked against the bytes by _finish
            self._buf.clear()
            self._member_done(m)
        return take

    def _scan(self, mv: memoryview) -> int:
        """A record of unknown size: held until a descriptor gives its size and CRC-32.

        Taken in slices that double with the record (from 64 KiB), so that a file of many
        small records costs no more than its bytes, and bounded by :data:`_MAX_SCANNED`.
        """
        m = self._cur
        assert m is not None
        buf = self._buf
        old = len(buf)
        take = min(len(mv), max(64 << 10, old))
        buf += mv[:take]
        dlen = self._desc_len()
        sig = struct.pack("<I", _DD)
        while True:
            p = buf.find(sig, self._scan_from)
            if p < 0:
                self._scan_from = max(0, len(buf) - 3)
                break
            if p + dlen > len(buf):
                self._scan_from = p
                break
            _, crc, csize, usize = self._desc_sizes(buf[p : p + dlen])
            if csize == usize == p:
                if zlib.crc32(buf[:p]) != crc:
                    raise NotStreamable  # a record that holds a look-alike descriptor
                m.crc = self._crc = crc
                m.size = p
                m.dest = memoryview(bytearray(buf[:p]))
                buf.clear()
                self._member_done(m)
                return p + dlen - old
            self._scan_from = p + 1
        if len(buf) > _MAX_SCANNED + dlen:
            raise NotStreamable  # a record too large to hold: read the file whole
        return take

    def result(self) -> dict[str, torch.Tensor]:
        """The decoded tensors, once the whole content was fed and checked.

        Raises:
            IntegrityError: the stream ended inside the archive, or its central directory
                disagrees with the members that streamed by (a CRC-32 too: each member's
                bytes matched their local one already).
        """
        if self._state != "dir":
            raise _bad(self.where, "the stream ended before the archive did")
        held = _held_directory(self.where, self._tail_base, self._buf, self._pos)
        listed = [(m.name, m.lho, m.size) for m in held]
        seen = [(m.name, m.lho, m.size) for m in self.members]
        if listed != seen:
            raise _bad(self.where, "the central directory disagrees with the local headers")
        for m, h in zip(self.members, held, strict=True):
            if m.crc != h.crc:
                raise IntegrityError(f"{self.where}: zip member {m.name!r} fails its CRC-32 check")
        return super().result()
