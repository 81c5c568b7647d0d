"""Streaming a stored ``torch.save`` zip: decoded or checked as its bytes go by.

Restores stream the archive (:class:`StreamDecoder`): ``torch.save`` stores every member
uncompressed, so each tensor's storage is a byte range of the file. The central directory
(at the end) is read and checked first, bounded; then the file streams front to back, block
by block checked: ``data.pkl`` (written first) is unpickled by torch's ``weights_only``
unpickler with storages on the ``meta`` device (no memory), which says which storage each
tensor views, and every storage's bytes go straight from the read buffers into the target
tensor, or a fresh one. An archive not laid out so is read whole and given to ``torch.load``.

The content of a compressed payload has no central directory to read first:
:class:`SequentialDecoder` follows it front to back and checks the directory last, and
:class:`ZipStreamChecker` checks it (``verify``) without torch. The whole-archive
functions (write, load, :func:`~ckptstore.codec.torchzip.check_zip`) are in
:mod:`ckptstore.codec.torchzip`.
"""

from __future__ import annotations

import io
import math
import pickle
import re
import struct
import zlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import IntegrityError, UnsafeCheckpointError
from ..integrity import BLOCK, check_blocks
from .torchzip import _compressed

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

#: Bounds on hostile archives: the central directory and the small records (data.pkl,
#: byteorder, version) are held in memory; a real one has a few hundred bytes per member.
MAX_DIRECTORY_BYTES = 64 << 20
MAX_RECORD_BYTES = 256 << 20
#: How much of the end of the file is searched for the end-of-central-directory record
#: (22 bytes, a comment of at most 64 KiB, a zip64 locator and record before it).
_TAIL = (64 << 10) + 22 + 20 + 56
_EOCD = 0x06054B50
_EOCD64 = 0x06064B50
_LOC64 = 0x07064B50
_CDH = 0x02014B50
_LFH = 0x04034B50


class _Member:
    __slots__ = ("crc", "data_start", "dest", "head", "lho", "name", "size")

    def __init__(self, name: str, lho: int, size: int, crc: int = 0) -> None:
        self.crc = crc  # the CRC-32 the central directory gives
        self.name = name
        self.lho = lho
        self.size = size
        self.data_start = -1  # known once its local header streamed by
        self.head = bytearray()
        self.dest: memoryview | None = None


class NotStreamable(Exception):
    """The archive is valid but not laid out as ``torch.save`` writes it."""


def _bad(where: str, what: str) -> IntegrityError:
    return IntegrityError(f"{where}: not a readable torch zip archive: {what}")


def parse_directory(size: int, read: Callable[[int, int], memoryview], where: str) -> list[_Member]:
    """The members of a stored zip of ``size`` bytes, from its (checked) central directory.

    Args:
        size: the file's size.
        read: ``read(offset, length)``: those bytes of the file, already checked.
        where: names the file in messages.

    Returns:
        The members in file order, each with its local header offset and stored size.

    Raises:
        IntegrityError: no end record, a directory out of bounds or over
            :data:`MAX_DIRECTORY_BYTES`, a compressed member, or members that overlap.
        NotStreamable: a multi-disk archive, or anything else torch.save never writes.
    """
    tail_len = min(size, _TAIL)
    tail = bytes(read(size - tail_len, tail_len))
    at = tail.rfind(struct.pack("<I", _EOCD))
    if at < 0 or at + 22 > len(tail):
        raise _bad(where, "no end of central directory record (truncated?)")
    _, disk, cd_disk, _, count, cd_size, cd_off, _ = struct.unpack("<IHHHHIIH", tail[at : at + 22])
    if disk or cd_disk:
        raise NotStreamable
    if 0xFFFF in (count,) or 0xFFFFFFFF in (cd_size, cd_off):
        loc = at - 20
        if loc < 0 or struct.unpack("<I", tail[loc : loc + 4])[0] != _LOC64:
            raise _bad(where, "zip64 end record locator missing")
        (z64,) = struct.unpack("<Q", tail[loc + 8 : loc + 16])
        rec_at = z64 - (size - tail_len)
        if not 0 <= rec_at <= len(tail) - 56:
            raise NotStreamable  # a zip64 record out of the tail: not torch.save's layout
        sig, _, _, _, _, _, _, count, cd_size, cd_off = struct.unpack(
            "<IQHHIIQQQQ", tail[rec_at : rec_at + 56]
        )
        if sig != _EOCD64:
            raise _bad(where, "zip64 end record missing")
    if cd_size > MAX_DIRECTORY_BYTES or cd_off + cd_size > size or count > cd_size // 46:
        raise _bad(where, f"central directory of {cd_size} bytes at {cd_off} is out of bounds")
    cd = bytes(read(cd_off, cd_size))
    members: list[_Member] = []
    pos = 0
    for _ in range(count):
        if pos + 46 > len(cd) or struct.unpack("<I", cd[pos : pos + 4])[0] != _CDH:
            raise _bad(where, "central directory entry malformed")
        (flags, method, _, _, crc, csize, usize, nlen, xlen, clen, disk_no, _, _, lho) = (
            struct.unpack("<HHHHIIIHHHHHII", cd[pos + 8 : pos + 46])
        )
        name_b = cd[pos + 46 : pos + 46 + nlen]
        extra = cd[pos + 46 + nlen : pos + 46 + nlen + xlen]
        pos += 46 + nlen + xlen + clen
        if pos > len(cd):
            raise _bad(where, "central directory entry runs past its end")
        if method != 0:
            raise _compressed(where, name_b.decode("utf-8", "replace"), method, csize, usize)
        if flags & 1:
            raise _bad(where, f"member {name_b!r} is encrypted")
        # zip64 extra: the fields that are 0xFFFFFFFF in the entry, in this order.
        want = [v == 0xFFFFFFFF for v in (usize, csize, lho)] + [disk_no == 0xFFFF]
        if any(want):
            vals = _zip64_extra(extra, sum(want[:3]), where)
            it = iter(vals)
            usize = next(it) if want[0] else usize
            csize = next(it) if want[1] else csize
            lho = next(it) if want[2] else lho
        if csize != usize:
            raise _bad(where, f"member {name_b!r} is stored in {csize} bytes but holds {usize}")
        members.append(_Member(name_b.decode("utf-8", "replace"), lho, usize, crc))
    members.sort(key=lambda m: m.lho)
    end = 0
    for m in members:
        # 30 header bytes at least, then the data: members may not overlap or pass the
        # central directory (a hostile one could point two members at one range).
        if m.lho < end or m.lho + 30 + m.size > cd_off:
            raise _bad(where, f"member {m.name!r} overlaps another or the central directory")
        end = m.lho + 30 + m.size
    return members


def _zip64_extra(extra: bytes, n: int, where: str) -> list[int]:
    pos = 0
    while pos + 4 <= len(extra):
        hid, hlen = struct.unpack("<HH", extra[pos : pos + 4])
        if hid == 1:
            if hlen < 8 * n or pos + 4 + 8 * n > len(extra):
                break
            return list(struct.unpack(f"<{n}Q", extra[pos + 4 : pos + 4 + 8 * n]))
        pos += 4 + hlen
    raise _bad(where, "zip64 sizes missing from a member's extra field")


class StreamDecoder:
    """Decodes a stored ``torch.save`` zip from the slices of a checked stream.

    Build it with :func:`open_stream` (a file of a store) or :meth:`from_buffer`; feed it
    ``(offset, slice)`` in file order (``Storage.stream_file`` passes checked blocks only);
    :meth:`result` gives the tensors. Each storage is copied once, from the slice into a
    tensor of ``into`` (same dtype and shape, contiguous, CPU, the storage's only tensor) or
    a fresh one.
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

    @classmethod
    def from_buffer(
        cls,
        data: bytes | bytearray | memoryview,
        where: str,
        into: Mapping[str, torch.Tensor] | None,
    ) -> StreamDecoder | None:
        """A decoder of a whole (checked) archive in memory; None: use ``torch.load``."""
        mv = memoryview(data).cast("B")
        try:
            members = parse_directory(len(mv), lambda o, n: mv[o : o + n], where)
            return cls(members, where, into)
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
            if a < b and m.dest is not None:
                m.dest[a - m.data_start : b - m.data_start] = chunk[a - offset : b - offset]
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
            if nbytes != m.size:
                raise _bad(
                    self.where, f"storage {rel!r} holds {m.size} bytes, data.pkl says {nbytes}"
                )
            return _bytes_of(buf)
        if m.size > MAX_RECORD_BYTES:
            raise _bad(self.where, f"record {m.name!r} of {m.size} bytes is too large")
        return memoryview(bytearray(m.size))

    def _finish(self, m: _Member) -> None:
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


def _lfh_lengths(head: bytearray) -> int:
    nlen, xlen = struct.unpack("<HH", head[26:30])
    return int(nlen + xlen)


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

        try:
            return StreamDecoder(parse_directory(entry.bytes, read, where), where, into)
        except NotStreamable:
            return None


# ---- streaming a compressed archive: no central directory first -------------------------

_DD = 0x08074B50
#: Most bytes of a record whose size its local header leaves to the data descriptor and
#: data.pkl does not give (data.pkl itself, byteorder, version, ...): searched for its end.
_MAX_SCANNED = MAX_RECORD_BYTES
#: Most members followed front to back (a central directory of its bound holds no more).
_MAX_MEMBERS = MAX_DIRECTORY_BYTES // 46


class SequentialDecoder(StreamDecoder):
    """Decodes a stored ``torch.save`` zip front to back, from its content alone.

    For an archive whose central directory cannot be read first (the content of a zstd
    stream, inflating in order). ``torch.save`` writes each member's sizes only after its
    data, in a data descriptor; so a storage's size comes from ``data.pkl`` (written
    first, and unpickled as soon as it is in) and goes straight into its tensor, while a
    small record (``data.pkl``, ``byteorder``, ...) is held until its descriptor is found
    (bounded by :data:`MAX_RECORD_BYTES`; the descriptor must give the bytes before it and
    their CRC-32). The central directory at the end (bounded by
    :data:`MAX_DIRECTORY_BYTES`) must then list exactly the members followed, or the
    archive is refused. Held at once: one record, the directory, and the last 64 KiB.

    Raises (from ``__call__`` and :meth:`result`):
        IntegrityError: the archive is malformed or its directory disagrees.
        NotStreamable: valid, perhaps, but not laid out as ``torch.save`` writes it: read
            the file whole.
    """

    def __init__(self, where: str, into: Mapping[str, torch.Tensor] | None) -> None:
        # Members are found as they stream by: none is known yet.
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
        (flags, method, _, _, _, csize, usize, nlen, xlen) = struct.unpack("<HHHHIIIHH", head[6:30])
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
        self._left = size
        self._state = "data"
        if not size:
            self._data_done(m)

    def _data_done(self, m: _Member) -> None:
        if self._sized:
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
            sig, _, csize, usize = self._desc_sizes(self._buf)
            if sig != _DD:
                raise NotStreamable  # a descriptor without its signature
            if csize != m.size or usize != m.size:
                raise _bad(self.where, f"member {m.name!r}: its descriptor says {usize} bytes")
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
                disagrees with the members that streamed by.
        """
        if self._state != "dir":
            raise _bad(self.where, "the stream ended before the archive did")
        held = _held_directory(self.where, self._tail_base, self._buf, self._pos)
        listed = [(m.name, m.lho, m.size) for m in held]
        seen = [(m.name, m.lho, m.size) for m in self.members]
        if listed != seen:
            raise _bad(self.where, "the central directory disagrees with the local headers")
        return super().result()


def _held_directory(where: str, base: int, tail: bytearray, size: int) -> list[_Member]:
    """The central directory of a ``size``-byte archive, parsed from its held tail.

    ``tail`` holds the archive's bytes from ``base`` on (a stream decoder's last bytes);
    a directory that points outside them is refused.
    """

    def read(offset: int, length: int) -> memoryview:
        if offset < base or offset + length > size:
            raise _bad(where, "the central directory is not where the members end")
        return memoryview(tail)[offset - base : offset - base + length]

    return parse_directory(size, read, where)


def _has_zip64(extra: bytes) -> bool:
    pos = 0
    while pos + 4 <= len(extra):
        hid, hlen = struct.unpack("<HH", extra[pos : pos + 4])
        if hid == 1:
            return True
        pos += 4 + hlen
    return False


class ZipStreamChecker:
    """Checks a stored zip front to back as it streams by, holding a few KiB, not the file.

    What :func:`check_zip` with ``deep`` checks of a whole archive, for the content of a
    compressed payload (``verify``): every member stored, not encrypted, its CRC-32
    right, and the central directory at the end (bounded by :data:`MAX_DIRECTORY_BYTES`)
    listing exactly the members that streamed by, with their sizes and CRCs. A member
    whose size its local header leaves to a data descriptor (``torch.save`` writes them
    so) ends at the first descriptor that gives the bytes before it and their CRC-32; the
    CRC runs along the data, so looking costs no second pass. Needs no torch.
    """

    def __init__(self, where: str) -> None:
        """Check the archive named ``where`` in messages."""
        self.where = where
        #: (name, local header offset, size, CRC-32) of the members seen, in file order.
        self.members: list[tuple[str, int, int, int]] = []
        self._pos = 0
        self._state = "head"
        self._buf = bytearray()  # a header or the directory
        self._name = ""
        self._lho = 0
        self._sized = True
        self._zip64 = False
        self._size = 0  # of the current member: known, or its bytes so far
        self._done = 0  # bytes of a member of known size seen
        self._want_crc = 0
        self._crc = 0
        self._carry = bytearray()  # unsized member: its last bytes, a descriptor may start there
        self._mismatch = ""  # the first member whose descriptor's sizes fit but not its CRC
        self._recent = bytearray()
        self._tail_base = -1
        #: The most bytes held at once.
        self.peak = 0

    def __call__(self, offset: int, chunk: memoryview) -> None:
        """Check the next ``chunk`` of the archive, found at ``offset`` (in order)."""
        if offset != self._pos:
            raise ValueError(f"bytes at {offset} fed after {self._pos}: feed in order")
        mv = memoryview(chunk).cast("B")
        while len(mv):
            state = self._state
            if state == "dir":
                self._buf += mv
                if len(self._buf) > MAX_DIRECTORY_BYTES + 2 * _TAIL:
                    raise _bad(self.where, "central directory over its bound")
                n = len(mv)
            elif state == "head":
                n = self._header(mv)
            elif state == "data":
                n = min(self._size - self._done, len(mv))
                self._crc = zlib.crc32(mv[:n], self._crc)
                self._done += n
                if self._done == self._size:
                    self._state = "desc" if not self._sized else "head"
                    if self._sized:
                        self._end_member(self._want_crc, self._size, self._size)
            elif state == "desc":
                n = self._descriptor(mv)
            else:
                n = self._scan(mv)
            if state != "dir":
                _keep_tail(self._recent, mv[:n])
            self._pos += n
            mv = mv[n:]
        self.peak = max(self.peak, len(self._buf) + len(self._recent) + len(self._carry))

    def _header(self, mv: memoryview) -> int:
        buf = self._buf
        need = 30 if len(buf) < 30 else 30 + _lfh_lengths(buf)
        take = min(need - len(buf), len(mv))
        buf += mv[:take]
        if len(buf) >= 4:
            sig = struct.unpack("<I", buf[:4])[0]
            if sig in (_CDH, _EOCD):  # __call__ keeps these bytes in _recent too
                self._buf = bytearray(self._recent) + mv[:take]
                self._tail_base = self._pos + take - len(self._buf)
                self._state = "dir"
                return take
            if sig != _LFH:
                raise _bad(self.where, f"no local header at byte {self._pos + take - len(buf)}")
        if len(buf) < 30 or len(buf) < 30 + _lfh_lengths(buf):
            return take
        (flags, method, _, _, crc, csize, usize, nlen, xlen) = struct.unpack(
            "<HHHHIIIHH", buf[6:30]
        )
        name = bytes(buf[30 : 30 + nlen]).decode("utf-8", "replace")
        extra = bytes(buf[30 + nlen : 30 + nlen + xlen])
        if method != 0:
            raise _compressed(self.where, name, method, csize, usize)
        if flags & 1:
            raise _bad(self.where, f"member {name!r} is encrypted")
        if len(self.members) >= _MAX_MEMBERS:
            raise _bad(self.where, f"more than {_MAX_MEMBERS} members")
        self._name, self._lho = name, self._pos + take - len(buf)
        self._zip64 = _has_zip64(extra)
        self._sized = not flags & 8
        self._crc = 0
        self._done = 0
        buf.clear()
        if self._sized:
            if self._zip64:
                usize, csize = _zip64_extra(extra, 2, self.where)
            if csize != usize:
                raise _bad(self.where, f"member {name!r} is stored in {csize} bytes, holds {usize}")
            self._size, self._want_crc = usize, crc
            self._state = "data"
            if not usize:
                self._state = "head"
                self._end_member(crc, 0, 0)
        else:
            self._size = 0
            self._carry.clear()
            self._state = "scan"
        return take

    def _dlen(self) -> int:
        return 24 if self._zip64 else 16

    def _desc(self, d: bytes | bytearray | memoryview) -> tuple[int, int, int, int]:
        sig, crc = struct.unpack("<II", d[:8])
        csize, usize = struct.unpack("<QQ" if self._zip64 else "<II", d[8 : self._dlen()])
        return sig, crc, csize, usize

    def _descriptor(self, mv: memoryview) -> int:
        take = min(self._dlen() - len(self._buf), len(mv))
        self._buf += mv[:take]
        if len(self._buf) == self._dlen():
            sig, crc, csize, usize = self._desc(self._buf)
            self._buf.clear()
            if sig != _DD:
                raise _bad(self.where, f"member {self._name!r} has no data descriptor")
            self._end_member(crc, csize, usize)
            self._state = "head"
        return take

    def _scan(self, mv: memoryview) -> int:
        """Member data of unknown size: its end is the first descriptor that matches it.

        ``_carry`` holds the last bytes of the member not yet known to be data (fewer than
        a descriptor: one may start in them); ``_size`` and ``_crc`` cover the bytes
        before. The carried bytes are looked at again with the next few.
        """
        carry = self._carry
        if not carry:
            return self._scan_buf(mv)
        held, dlen = len(carry), self._dlen()
        if len(mv) < dlen:  # a tiny piece: carried bytes and piece scanned as one
            head = bytes(carry) + bytes(mv)
            carry.clear()
            return self._scan_buf(memoryview(head)) - held
        # Every descriptor that starts in the carried bytes ends in the next dlen - 1.
        head = bytes(carry) + bytes(mv[: dlen - 1])
        q = _find(memoryview(head), 0)
        while 0 <= q < held:
            _, crc, csize, usize = self._desc(head[q : q + dlen])
            if csize == usize == self._size + q and crc == zlib.crc32(head[:q], self._crc):
                self._size, self._crc = self._size + q, crc
                carry.clear()
                self._end_member(crc, csize, usize)
                self._state = "head"
                return q + dlen - held
            if csize == usize == self._size + q:
                self._mismatch = self._mismatch or self._name
            q = _find(memoryview(head), q + 1)
        self._crc = zlib.crc32(carry, self._crc)
        self._size += held
        carry.clear()
        return self._scan_buf(mv)

    def _scan_buf(self, buf: memoryview) -> int:
        """Scan ``buf`` (the next bytes of the member); returns how many were used."""
        dlen = self._dlen()
        start = 0  # buf[:start] is data, counted in _size and _crc
        p = _find(buf, 0)
        while p >= 0 and p + dlen <= len(buf):
            _, crc, csize, usize = self._desc(buf[p : p + dlen])
            if csize == usize == self._size + p - start:  # cheap: the CRC only then
                self._crc = zlib.crc32(buf[start:p], self._crc)
                self._size += p - start
                start = p
                if crc == self._crc:
                    self._end_member(crc, csize, usize)
                    self._state = "head"
                    return p + dlen
                self._mismatch = self._mismatch or self._name  # its data, or a look-alike
            p = _find(buf, p + 1)
        keep = max(start, len(buf) - (dlen - 1))
        self._crc = zlib.crc32(buf[start:keep], self._crc)
        self._size += keep - start
        self._carry += buf[keep:]
        return len(buf)

    def _end_member(self, crc: int, csize: int, usize: int) -> None:
        if csize != usize or usize != self._size:
            raise _bad(self.where, f"member {self._name!r}: its sizes disagree")
        if crc != self._crc:
            raise IntegrityError(f"{self.where}: zip member {self._name!r} fails its CRC-32 check")
        self.members.append((self._name, self._lho, self._size, crc))

    def finish(self) -> int:
        """Check the central directory against the members; returns their number.

        Raises:
            IntegrityError: the archive is truncated, or its directory disagrees.
        """
        if self._state != "dir":
            if self._mismatch:  # a descriptor of the right size was passed over: its CRC
                raise IntegrityError(
                    f"{self.where}: zip member {self._mismatch!r} fails its CRC-32 check"
                )
            raise _bad(self.where, "the stream ended before the archive did")
        listed = _held_directory(self.where, self._tail_base, self._buf, self._pos)
        if not any(n.endswith("/data.pkl") or n == "data.pkl" for n, *_ in self.members):
            raise IntegrityError(
                f"{self.where}: zip archive has no data.pkl; not a torch.save file"
            )
        got = [(m.name, m.lho, m.size, m.crc) for m in listed]
        if got != self.members:
            raise _bad(self.where, "the central directory disagrees with the local headers")
        return len(self.members)


_DD_RE = re.compile(re.escape(struct.pack("<I", _DD)))


def _find(mv: memoryview, start: int) -> int:
    """Where the next data descriptor signature in ``mv`` starts (-1: none); no copy."""
    m = _DD_RE.search(mv, start)
    return -1 if m is None else m.start()


def _keep_tail(recent: bytearray, b: memoryview) -> None:
    """Keep the last bytes before a zip's directory: its end record is searched there."""
    if len(b) >= _TAIL:
        recent[:] = b[-_TAIL:]
    else:
        recent += b
        if len(recent) > 2 * _TAIL:
            del recent[:-_TAIL]
